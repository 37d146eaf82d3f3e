"""The C++ decode stack (kernels/cpu/decode_stack.py) computes a decode step as the module
forward does: the same residual stream, the same K/V written into the pool, for every
projection kernel it can call, with and without a qkv bias, for several rows (one a padded
row that writes nowhere); and the steps it cannot serve take the module forward."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tokenloom.actors.execution.batch_inputs import build_batch_inputs
from tokenloom.kernels.cpu import decode_stack, kernel_plan, kernel_set, onednn
from tokenloom.kernels.cpu.attention import load_cpu_decode_kernel, paged_decode_cpu
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.models.random_model import SHAPES, random_model

BLOCK = 8


@dataclasses.dataclass
class Seq:  # the fields of messages.ScheduledSequence that build_batch_inputs reads
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True


@dataclasses.dataclass
class Batch:
    sequences: list[Seq]
    num_decodes: int


@pytest.fixture(scope="module", autouse=True)
def built():
    # The CI machine has a compiler: a build that fails there is a bug, not a skip.
    if load_cpu_decode_kernel() is None or decode_stack.module() is None:
        pytest.fail("the C++ decode attention and decode stack must build on the CI machine")


def _model(storage: str, bias: bool, dtype: torch.dtype = torch.float32,
           kernel: str | None = None, monkeypatch=None, qk_norm: bool = False,
           rotary_dim: int = 0):
    """`kernel`: every projection runs it at every row count (else: the measured plan).
    `qk_norm`: Qwen3's per-head q/k norms, with weights away from 1. `rotary_dim`: partial
    rotary (0: the whole head)."""
    spec = dataclasses.replace(SHAPES["tiny"], attention_bias=bias, qk_norm=qk_norm)
    spec = dataclasses.replace(spec, rope=dataclasses.replace(spec.rope, rotary_dim=rotary_dim))
    model = random_model(spec, dtype, "cpu", max_positions=256, seed=7)
    if qk_norm:
        gen = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for layer in model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.copy_(torch.rand(norm.weight.shape, generator=gen) + 0.5)
    if bias:   # random_model leaves biases at 0: make them count (seeded: the same model
        # whatever ran before in this process)
        gen = torch.Generator().manual_seed(8)
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.qkv_proj.bias.normal_(0, 0.5, generator=gen)
    if kernel is not None:
        forced = kernel_plan.Plan(((1 << 30, kernel),), {})
        monkeypatch.setattr(kernel_plan, "cached_plan", lambda *a, **k: forced)
    model.specialize_cpu(storage)
    model.set_decode_kernel(paged_decode_cpu)
    assert decode_stack.install(model)
    return spec, model


def _hidden(model, kv, seqs, num_decodes):
    inputs = build_batch_inputs(Batch(seqs, num_decodes), BLOCK, torch.device("cpu"))
    return model.forward_hidden(inputs.input_ids, inputs.positions, kv, inputs.meta)


def _stack_equals_module(spec, model, dtype, row_counts=(1, 3), pool_dtype=None):
    """`pool_dtype`: the KV pool's dtype when it is not the model's (cache.kv_dtype bf16 /
    fp16 under an fp32 model)."""
    seqs = max(row_counts)
    kv = KVCache.allocate(spec.num_layers, 6 * seqs + 2, BLOCK, spec.num_kv_heads,
                          spec.head_dim, pool_dtype or dtype, "cpu")
    gen = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(3, spec.vocab_size, (n,), generator=gen).tolist()  # noqa
    # Block tables out of order and of different lengths; contexts across block edges.
    free = torch.randperm(6 * seqs + 2, generator=gen).tolist()
    lens = [(9, 25, 33)[i % 3] + i % 5 for i in range(seqs)]
    tables = [[free.pop() for _ in range(n // BLOCK + 1)] for n in lens]
    stacks = model.decode_stacks
    for i, n in enumerate(lens):                       # prefills: the module forward
        _hidden(model, kv, [Seq(str(i), tok(n), 0, tables[i])], 0)
    assert stacks.steps == 0
    decodes = [Seq(str(i), tok(1), lens[i], tables[i]) for i in range(seqs)]
    before = kv.pool.clone()
    for rows in row_counts:
        step = decodes[:rows]
        kv.pool.copy_(before)
        fast = _hidden(model, kv, step, rows)
        assert stacks.steps > 0, stacks._by_kernels
        fast_pool = kv.pool.clone()
        kv.pool.copy_(before)
        model.decode_stacks = None
        try:
            ref = _hidden(model, kv, step, rows)
        finally:
            model.decode_stacks = stacks
        assert fast.shape == ref.shape == (rows, spec.hidden_size)
        # fp32: RoPE's products may be fused into FMAs, last-bit differences and nothing
        # more. bf16 rounds where torch rounds, but the norm's fp32 sum may be ordered
        # otherwise: now and then a value lands one bf16 step away.
        # q4/q8 block kernels quantize activations to int8 blocks per call: such a
        # last-bit difference can flip one rounding there (measured up to ~4e-5 relative
        # here; before the biases were seeded, other draws flipped more, up to 1.9e-4).
        blocks = model.layers[0].mlp.down_proj.storage in kernel_set.BLOCK_STORAGES
        tol = (1e-4 if blocks else 1e-5) if dtype == torch.float32 else 2e-2
        pool_tol = tol
        if pool_dtype is not None:
            # A key whose fp32 value differs in the last bit (RoPE's FMAs) can round to
            # the neighbouring 2-byte value: one step of the pool's dtype.
            pool_tol = 2 * torch.finfo(pool_dtype).eps * kv.pool.float().abs().max().item()
            tol = 2e-2
        diff = (fast.float() - ref.float()).abs().max().item()
        assert diff <= tol * ref.float().abs().max().item() + 1e-6, diff
        assert (fast_pool.float() - kv.pool.float()).abs().max().item() <= pool_tol
        assert not torch.equal(fast_pool, before)        # the step's K/V were written


@pytest.mark.parametrize("storage,dtype", [
    ("float", torch.float32), ("q4", torch.float32), ("q8", torch.float32),
    ("int8", torch.float32), ("float", torch.bfloat16), ("q4", torch.bfloat16)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_decode_step_on_the_stack_equals_the_module_forward(storage, dtype, bias):
    spec, model = _model(storage, bias, dtype)
    _stack_equals_module(spec, model, dtype)


@pytest.mark.parametrize("storage,dtype", [
    ("float", torch.float32), ("q4", torch.float32), ("float", torch.bfloat16)])
def test_qwen3_q_k_norms_run_on_the_stack_as_in_the_module_forward(storage, dtype):
    spec, model = _model(storage, False, dtype, qk_norm=True)
    assert decode_stack.unsupported(spec) is None
    _stack_equals_module(spec, model, dtype)


@pytest.mark.parametrize("storage,dtype", [
    ("float", torch.float32), ("q4", torch.float32), ("float", torch.bfloat16)])
def test_partial_rotary_runs_on_the_stack_as_in_the_module_forward(storage, dtype):
    spec, model = _model(storage, False, dtype, rotary_dim=SHAPES["tiny"].head_dim // 2)
    assert decode_stack.unsupported(spec) is None
    _stack_equals_module(spec, model, dtype)


@pytest.mark.parametrize("storage,pool_dtype", [
    ("float", torch.bfloat16), ("float", torch.float16), ("q4", torch.bfloat16)])
def test_an_fp32_model_over_a_two_byte_pool_runs_on_the_stack(storage, pool_dtype):
    """cache.kv_dtype bf16 / fp16: the stack rounds K/V into the pool as store_kv does and
    reads them back widened, as the module forward's kernels do."""
    spec, model = _model(storage, True, torch.float32)
    _stack_equals_module(spec, model, torch.float32, (1, 3), pool_dtype)


@pytest.mark.parametrize("storage,kernel", [
    ("float", "mkl"), ("float", "small_gemm"), ("float", "small_gemm_strips"),
    ("float", "onednn"), ("q4", "block_gemm"), ("int8", "small_gemm_strips_int8"),
    ("q8", "block_gemm"), ("q4", "copy_mkl"), ("q4", "copy_onednn"),
    ("int8", "small_gemm_int8"), ("int8", "int8pack_bf16"), ("float", "tile_gemm"),
    ("q4", "copy_tile_bf16"), ("int8", "tile_gemm_int8"), ("float", "tile_gemm_f32")])
def test_every_kernel_the_stack_calls_at_decode_and_padded_row_counts(storage, kernel,
                                                                        monkeypatch):
    # 20 rows: oneDNN is called at a padded row count above 16 (kernels/cpu/onednn.py).
    if "onednn" in kernel and not onednn.onednn_available():
        pytest.skip("this torch build has no oneDNN packed linear")
    if kernel == "int8pack_bf16" and not kernel_set.has_int8_weight_op():
        pytest.skip("this torch build has no int8 weight matmul")
    if "tile" in kernel and not kernel_plan._available(kernel):
        pytest.skip("tile_gemm not built here (no AVX512-BF16, no AVX2 + FMA)")
    # torch's int8 matmul is a candidate only with bf16 activations, tile_gemm is bf16 only
    dtype = torch.bfloat16 if kernel in ("int8pack_bf16", "tile_gemm") else torch.float32
    spec, model = _model(storage, True, dtype, kernel, monkeypatch)
    assert model.layers[0].mlp.down_proj.kernel_for(20) == kernel
    _stack_equals_module(spec, model, dtype, (1, 3, 16, 20))
    assert model.decode_stacks.for_rows(20) is not None


def test_a_padded_row_writes_nowhere_and_prefills_take_the_module_forward():
    spec, model = _model("float", False)
    kv = KVCache.allocate(spec.num_layers, 16, BLOCK, spec.num_kv_heads, spec.head_dim,
                          torch.float32, "cpu")
    _hidden(model, kv, [Seq("a", list(range(3, 15)), 0, [4, 5])], 0)
    inputs = build_batch_inputs(Batch([Seq("a", [20], 12, [4, 5])], 1), BLOCK,
                                torch.device("cpu"))
    inputs.meta.slot_mapping.fill_(-1)
    before = kv.pool.clone()
    model.forward_hidden(inputs.input_ids, inputs.positions, kv, inputs.meta)
    assert model.decode_stacks.steps == 1
    assert torch.equal(kv.pool, before)
    # A step with a prefill chunk in it is not the stack's while prefill attention is SDPA
    # (with the C++ prefill kernel it is: the mixed-step test below).
    _hidden(model, kv, [Seq("a", [20], 12, [4, 5]), Seq("b", [7, 8, 9], 0, [6])], 1)
    assert model.decode_stacks.steps == 1


@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.float32, torch.bfloat16)])
def test_a_mixed_step_on_the_stack_equals_the_module_forward(dtype, pool_dtype):
    """Decode rows and prefill chunks in one step (a fresh prompt and a continuation chunk
    after 9 cached tokens, across block edges): with the C++ prefill attention the stack
    serves the step, and its residual stream and written K/V are the module forward's."""
    from tokenloom.kernels.cpu.attention import prefill_attention_cpu

    spec, model = _model("float", True, dtype)
    model.set_prefill_kernel(prefill_attention_cpu)
    kv = KVCache.allocate(spec.num_layers, 24, BLOCK, spec.num_kv_heads, spec.head_dim,
                          pool_dtype or dtype, "cpu")
    gen = torch.Generator().manual_seed(11)
    tok = lambda n: torch.randint(3, spec.vocab_size, (n,), generator=gen).tolist()  # noqa
    stacks = model.decode_stacks
    model.decode_stacks = None          # the earlier tokens through the module forward
    _hidden(model, kv, [Seq("a", tok(12), 0, [4, 5])], 0)
    _hidden(model, kv, [Seq("b", tok(20), 0, [9, 2, 7])], 0)
    _hidden(model, kv, [Seq("c", tok(9), 0, [11, 3])], 0)
    model.decode_stacks = stacks
    step = [Seq("a", tok(1), 12, [4, 5]), Seq("b", tok(1), 20, [9, 2, 7]),
            Seq("d", tok(11), 0, [13, 14]), Seq("c", tok(7), 9, [11, 3])]
    before = kv.pool.clone()
    fast = _hidden(model, kv, step, 2)
    assert stacks.steps == 1
    fast_pool = kv.pool.clone()
    kv.pool.copy_(before)
    model.decode_stacks = None
    ref = _hidden(model, kv, step, 2)
    model.decode_stacks = stacks
    assert fast.shape == ref.shape == (20, spec.hidden_size)
    tol = 1e-5 if dtype == torch.float32 and pool_dtype is None else 2e-2   # as above
    pool_tol = tol if pool_dtype is None else (
        2 * torch.finfo(pool_dtype).eps * kv.pool.float().abs().max().item())
    assert (fast.float() - ref.float()).abs().max().item() <= tol * ref.float().abs().max().item()
    assert (fast_pool.float() - kv.pool.float()).abs().max().item() <= pool_tol


def test_a_kernel_the_stack_cannot_call_leaves_the_module_forward():
    spec, model = _model("float", False)
    for layer in model.layers:      # as if the planner had chosen a kernel the stack lacks
        layer.self_attn.o_proj._bands = ((1 << 30, "a_kernel_the_stack_lacks"),)
    assert model.layers[0].self_attn.o_proj.kernel_for(1) == "a_kernel_the_stack_lacks"
    assert model.decode_stacks.for_rows(1) is None
    for layer in model.layers:
        layer.self_attn.o_proj._bands = ((1 << 30, "small_gemm"),)
    model.decode_stacks = decode_stack.DecodeStacks(model)
    kv = KVCache.allocate(spec.num_layers, 16, BLOCK, spec.num_kv_heads, spec.head_dim,
                          torch.float32, "cpu")
    _hidden(model, kv, [Seq("a", list(range(3, 15)), 0, [4, 5])], 0)
    _hidden(model, kv, [Seq("a", [20], 12, [4, 5])], 1)
    assert model.decode_stacks.steps == 1


F32_POOLS = (torch.float32, torch.bfloat16, torch.float16)
TEAM_CASES = [   # (weights, kernel, activations, pool)
    *[(storage, kernel, torch.float32, pool) for storage, kernel in [
        ("q4", "block_gemm"), ("q8", "block_gemm"), ("float", "small_gemm"),
        ("float", "small_gemm_strips"), ("float", "tile_gemm_f32"), ("q4", "copy_tile_bf16"),
        ("int8", "tile_gemm_int8"), ("int8", "small_gemm_int8")] for pool in F32_POOLS],
    *[(storage, kernel, torch.bfloat16, torch.bfloat16) for storage, kernel in [
        ("float", "small_gemm"), ("float", "small_gemm_strips"), ("float", "tile_gemm"),
        ("int8", "small_gemm_int8"), ("int8", "tile_gemm_int8")]],
]


@pytest.mark.parametrize("storage,kernel,dtype,pool_dtype", TEAM_CASES)
def test_one_openmp_team_per_step_is_bit_identical_to_a_team_per_kernel(storage, kernel, dtype,
                                                                         pool_dtype,
                                                                         monkeypatch):
    """The team path (csrc/team.h) splits the same tiles and attention spans over one
    parallel region: the residual stream and the pool come out bit-identical to the
    per-call path's, at decode row counts 1, 3 and 16, on the default model's widths (the
    packed layout's groups of 16 blocks and its tail), in fp32 and bf16 activations."""
    spec = dataclasses.replace(SHAPES["smollm2-135m"], num_layers=2, vocab_size=256)
    if "tile" in kernel and not kernel_plan._available(kernel):
        pytest.skip("tile_gemm not built here (no AVX2 + FMA)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the team path needs 2 CPUs (it steps aside for more threads than CPUs)")
    bf16_tiles = kernel in ("copy_tile_bf16", "tile_gemm")
    if bf16_tiles and kernel_set.tile_gemm_module().tile_gemm_path() != "fma":
        pytest.skip("bf16 tiles run vdpbf16ps here: no team kernel (the per-call path)")
    if (dtype == torch.bfloat16 and storage == "float"
            and kernel_set.small_gemm_module().bf16_dot_build()):
        pytest.skip("bf16 x bf16 runs vdpbf16ps here: no team kernel (the per-call path)")
    model = random_model(spec, dtype, "cpu", max_positions=512, seed=11)
    forced = kernel_plan.Plan(((1 << 30, kernel),), {})
    monkeypatch.setattr(kernel_plan, "cached_plan", lambda *a, **k: forced)
    model.specialize_cpu(storage)
    model.set_decode_kernel(paged_decode_cpu)
    assert decode_stack.install(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    mod = decode_stack.module()
    try:
        seqs = 16
        kv = KVCache.allocate(spec.num_layers, 20 * seqs, BLOCK, spec.num_kv_heads,
                              spec.head_dim, pool_dtype, "cpu")
        gen = torch.Generator().manual_seed(5)
        free = torch.randperm(20 * seqs, generator=gen).tolist()
        lens = [(3, 70, 129)[i % 3] + i for i in range(seqs)]   # 1 to 3 spans of 64 keys
        tables = [[free.pop() for _ in range(n // BLOCK + 1)] for n in lens]
        kv.pool.normal_(0, 1, generator=gen)                   # a context to attend to
        decodes = [Seq(str(i), [int(3 + i)], lens[i], tables[i]) for i in range(seqs)]
        before = kv.pool.clone()
        for rows in (1, 3, 16):
            step = decodes[:rows]
            stack = model.decode_stacks.for_rows(rows)
            assert model.decode_stacks.team_kernels[(kernel,) * 4]
            served = stack.team_steps()
            mod.use_team(True)
            team = _hidden(model, kv, step, rows)
            assert stack.team_steps() == served + 1
            team_pool = kv.pool.clone()
            kv.pool.copy_(before)
            mod.use_team(False)
            calls = _hidden(model, kv, step, rows)
            assert stack.team_steps() == served + 1
            assert torch.equal(team, calls)
            assert torch.equal(team_pool, kv.pool)
            kv.pool.copy_(before)
        # Without the attention's vector path there is no team kernel: the per-call path.
        mod.use_team(True)
        load_cpu_decode_kernel().use_vector_path(False)
        try:
            served = stack.team_steps()
            _hidden(model, kv, decodes[:16], 16)
            assert stack.team_steps() == served
        finally:
            load_cpu_decode_kernel().use_vector_path(True)
        # More threads than CPUs: a spin barrier would wait on descheduled threads, so the
        # per-call path serves (4 threads on 2 cores made a team step 7x slower).
        kv.pool.copy_(before)
        torch.set_num_threads(len(os.sched_getaffinity(0)) + 1)
        served = stack.team_steps()
        _hidden(model, kv, decodes[:16], 16)
        assert stack.team_steps() == served
    finally:
        mod.use_team(True)
        torch.set_num_threads(threads)
