"""q4/q8 block weights (kernels/cpu/blocks.py) and their C++ kernels
(csrc/block_gemm_cpu.cpp): GGUF's bytes read as gguf-py dequantizes them, quantization
bounded by half a step, the kernels equal x . dequantize(W)^T at every row count a step can
have, the GGUF q/k row order undone, and a q4 model computing with exactly its blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from tokenloom.kernels.cpu import blocks as blk
from tokenloom.kernels.cpu import kernel_set
from tokenloom.kernels.cpu import linear as cpu_linear
from tokenloom.kernels.models import gguf_blocks, quality_gate
from tokenloom.kernels.models.loader import load_model

from tinymodel import VOCAB, build_tiny_model

needs_kernel = pytest.mark.skipif(kernel_set.block_gemm_module() is None,
                                  reason="no C++ toolchain")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_as_gguf_py_does(kind):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 96)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[kind])
    expected = quants.dequantize(raw, GGMLQuantizationType[kind])
    b = blk.from_gguf(kind, torch.from_numpy(raw.copy()), 6, 96)
    assert isinstance(b, blk.Q8Blocks if kind == "Q8_0" else blk.Q4Blocks)
    assert torch.equal(blk.dequantize(b), torch.from_numpy(expected))


def test_quantization_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(8, 128) * 0.1
    w[0, :32] = 0.5                      # a constant block: scale 0, exact
    q4 = blk.quantize_q4(w)
    step = q4.d.float().repeat_interleave(32, dim=1)
    err = (blk.dequantize(q4) - w).abs()
    assert torch.all(err <= step / 2 + 1e-3 * w.abs() + 1e-6)
    assert torch.allclose(blk.dequantize(q4)[0, :32], w[0, :32], atol=1e-3)
    q8 = blk.quantize_q8(w)
    step8 = q8.d.float().repeat_interleave(32, dim=1)
    assert torch.all((blk.dequantize(q8) - w).abs() <= step8 / 2 + 1e-6)


def test_widths_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        blk.quantize_q4(torch.randn(4, 40))
    assert not blk.blockable((4, 40)) and blk.blockable((4, 64))


def _packed_built() -> bool:
    module = kernel_set.block_gemm_module()
    return module is not None and module.packed_built()


@pytest.fixture
def path(request):
    """Which of the compiled paths serves the call: "widest" (AVX-512 VNNI where built),
    "next" (the AVX2 or plain-loop one: the widest turned off), "packed" (the widest kernel
    over pack_groups' layout: VNNI, else AVX2) or "packed-next" (the AVX2 kernel over that
    layout, on a VNNI build too)."""
    module = kernel_set.block_gemm_module()
    if request.param.startswith("packed") and not _packed_built():
        pytest.skip("built without AVX2")
    module.use_widest_path(request.param not in ("next", "packed-next"))
    yield request.param
    module.use_widest_path(True)


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 67])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["widest", "next", "packed", "packed-next"], indirect=True)
def test_kernel_equals_the_dequantized_matmul(fmt, rows, act, path):
    torch.manual_seed(rows)
    # 70 rows: not a multiple of any tile or split. 1,568 columns = 49 blocks: three packed
    # groups of 16, then a lone block; 576 = one group and a pair.
    n, k = 70, 1568 if rows % 2 else 576
    w = torch.randn(n, k) * 0.05
    b = blk.quantize_q4(w) if fmt == "q4" else blk.quantize_q8(w)
    bias = torch.randn(n)
    x = torch.randn(rows, k).to(act)
    # The kernels quantize activations to int8 blocks (as llama.cpp does for Q4_1 / Q8_0).
    ref = blk.quantize_activations(x.float()) @ blk.dequantize(b).T + bias
    ops = torch.ops.tokenloom
    packed = path.startswith("packed")
    qs = blk.pack_groups(b.qs) if packed else b.qs
    if fmt == "q4":
        y = (ops.q4_gemm_packed if packed else ops.q4_gemm)(x, qs, b.d, b.m, bias.to(act))
    else:
        y = (ops.q8_gemm_packed if packed else ops.q8_gemm)(x, qs, b.d, bias.to(act))
    assert y.dtype == act and y.shape == (rows, n)
    # (A tie in the activations' rounding may go the other way: one code step of one x.)
    tol = 1e-3 if act == torch.float32 else 2e-2
    assert torch.allclose(y.float(), ref, atol=tol * ref.abs().max(), rtol=tol), \
        (y.float() - ref).abs().max()
    exact = x.float() @ blk.dequantize(b).T + bias     # and close to the unquantized product
    assert (y.float() - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_packed_layout_moves_four_codes_of_sixteen_blocks_into_each_64_bytes(fmt):
    torch.manual_seed(0)
    b = (blk.quantize_q4 if fmt == "q4" else blk.quantize_q8)(torch.randn(3, 32 * 35))
    packed = blk.pack_groups(b.qs)
    per_block = 16 if fmt == "q4" else 32
    assert packed.shape == b.qs.shape and packed.dtype == b.qs.dtype
    for block, j in [(0, 0), (5, 7), (15, per_block - 1), (17, 2), (31, 9)]:
        group, i = divmod(block, 16)
        at = group * 16 * per_block + (j // 4) * 64 + i * 4 + j % 4
        assert torch.equal(packed[:, at], b.qs[:, block * per_block + j])
    tail = 32 * per_block                    # blocks 32-34 stay as they are
    assert torch.equal(packed[:, tail:], b.qs[:, tail:])
    assert torch.equal(blk.unpack_groups(packed), b.qs)


@needs_kernel
def test_kernel_refuses_mismatched_blocks():
    b = blk.quantize_q4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="multiple of 32|do not match"):
        torch.ops.tokenloom.q4_gemm(torch.randn(2, 96), b.qs, b.d, b.m, torch.empty(0))


def test_gguf_q_k_row_order_is_undone():
    # llama.cpp's converter: w.reshape(heads, 2, dim/heads/2, K).swapaxes(1, 2)
    heads, rows, k = 3, 24, 8
    w = torch.arange(rows * k, dtype=torch.float32).reshape(rows, k)
    gguf_w = w.reshape(heads, 2, rows // heads // 2, k).swapaxes(1, 2).reshape(rows, k)
    assert torch.equal(gguf_w[gguf_blocks.llama_unpermute_rows(rows, heads)], w)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4-tiny")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=5)
    return path


@pytest.mark.parametrize("mode", ["q4", "q8"])
def test_block_model_computes_with_exactly_its_blocks(tiny_dir, mode):
    """A q4 (q8) model's logits are those of an fp32 model whose weights are its blocks
    dequantized when it runs the exact dequantized copy, and close to them with the kernels
    it planned (which round activations), its greedy tokens near the reference's best."""
    ids = [(5 * i + 3) % (VOCAB - 3) + 3 for i in range(40)]
    quant, _ = load_model(tiny_dir, torch.float32, torch.device("cpu"), 256)
    quant.specialize_cpu(mode)
    ref, _ = load_model(tiny_dir, torch.float32, torch.device("cpu"), 256)
    ref._layout_done = True
    with torch.no_grad():
        for i, qlayer in enumerate(quant.layers):
            for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                         "mlp.down_proj"):
                ks = qlayer.get_submodule(name).kernels
                assert ks.storage == mode
                weight = blk.dequantize(ks.blocks())
                ref.get_submodule(f"layers.{i}.{name}").weight.copy_(weight)
        hk = quant.lm_head.kernels
        assert hk.storage == "q8"            # the head stays 8-bit in both modes
        ref.lm_head = torch.nn.Linear(*reversed(hk.qs.shape), bias=False)
        ref.lm_head.weight.copy_(blk.dequantize(hk.blocks()))
    with torch.inference_mode():
        a = quality_gate.teacher_forced_logits(ref, ids).float()    # prefill-sized calls
        b = quality_gate.teacher_forced_logits(quant, ids).float()
        # The planned kernels round activations (int8 blocks, or bf16 in copy_tile_bf16):
        # on this random model the block kernel everywhere is off by ~7% of the largest
        # logit, bf16 by ~3%.
        assert (a - b).abs().max() <= 0.1 * a.abs().max(), (a - b).abs().max()
        greedy = quality_gate.greedy_continuation(quant, ids[:8], 12)   # one-row calls
        # Each token it picks is, by the reference's own logits, within twice the bound of
        # the reference's best (an exact tie-break would depend on which kernel start-up
        # measured fastest on this CPU).
        tol = 0.2 * a.abs().max()
        ref_rows = quality_gate.teacher_forced_logits(ref, ids[:8] + greedy).float()[7:-1]
        picked = ref_rows.gather(1, torch.tensor(greedy)[:, None])[:, 0]
        assert (ref_rows.max(dim=1).values - picked <= tol).all(), (greedy, tol)
        # With the exact dequantized copy everywhere, the logits are the reference's.
        for lin in quant.modules():
            if isinstance(lin, cpu_linear.CpuLinear):
                lin._bands = ((1 << 30, "copy_mkl"),)
        exact = quality_gate.teacher_forced_logits(quant, ids).float()
        torch.testing.assert_close(exact, a, rtol=1e-4, atol=1e-4 * a.abs().max().item())


@pytest.mark.parametrize("storage", ["q4", "q8"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_every_block_candidate_matches_the_dequantized_weight(storage, act):
    """The kernels the planner may pick for q4/q8 (the block kernel and the kept dequantized
    copies, plain and oneDNN-packed) all compute x . dequantize(W)^T + b."""
    torch.manual_seed(3)
    w, b = torch.randn(48, 576) * 0.1, torch.randn(48) * 0.1   # a packed group and a pair
    kernels = kernel_set.KernelSet(w, b, storage, act)
    assert {"copy_mkl"} <= set(kernels.names)
    assert kernels.grouped == _packed_built()
    # the bf16 copy is offered to fp32 models only, where tile_gemm is built
    assert ("copy_tile_bf16" in kernels.names) == (act == torch.float32 and
                                                    kernel_set.tile_gemm_module() is not None)
    deq = blk.dequantize(kernels.blocks())
    tol = 1e-4 if act == torch.float32 else 3e-2
    for rows in (1, 6, 40):
        x = torch.randn(rows, 576).to(act)
        ref = torch.nn.functional.linear(x.float(), deq.to(act).float(), b.to(act).float())
        qref = torch.nn.functional.linear(blk.quantize_activations(x.float()),
                                          deq.to(act).float(), b.to(act).float())
        # copy_tile_bf16 (fp32 models): x and the dequantized W rounded to bf16, fp32 sums
        bref = torch.nn.functional.linear(x.float().bfloat16().float(),
                                          deq.bfloat16().float(), b.to(act).float())
        with torch.inference_mode():
            for name in kernels.names:
                expected = {"block_gemm": qref, "copy_tile_bf16": bref}.get(name, ref)
                torch.testing.assert_close(kernels.run(name, x).float(), expected, rtol=tol,
                                           atol=tol, msg=name)


def test_copies_are_left_out_when_excluded():
    w = torch.randn(8, 64)
    kernels = kernel_set.KernelSet(w, None, "q4", torch.float32,
                                   excluded=frozenset(kernel_set.COPY_KERNELS))
    assert not set(kernels.names) & kernel_set.COPY_KERNELS
    assert getattr(kernels, "w", None) is None


def test_a_tied_head_and_its_embedding_share_one_copy_in_float_storage(tiny_dir, monkeypatch):
    """In the model's own dtype the head's weight is moved to the huge-page arena
    (kernels/cpu/allocator.py): the embedding follows it instead of keeping the old copy,
    and lookups and logits are unchanged."""
    from tokenloom.kernels.cpu import allocator

    monkeypatch.setattr(allocator, "ARENA_MIN_BYTES", 0)   # the tiny model's head too
    model, _ = load_model(tiny_dir, torch.float32, torch.device("cpu"), 256)
    before = model.embed_tokens.weight.detach().clone()
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    model.specialize_cpu("float")
    assert model.embed_tokens.weight.data_ptr() == model.lm_head.kernels.w.data_ptr()
    assert torch.equal(model.embed_tokens.weight, before)


def test_the_placed_weights_reported_are_this_models_alone(tiny_dir, monkeypatch, tmp_path):
    """The start-up log's "MiB of weights placed for huge pages" counts this model's
    weights: not the plans' trial copies, nor another model loaded earlier in the process
    (the arena's own counter only grows)."""
    from tokenloom.kernels.cpu import allocator

    if not allocator.huge_pages_possible():
        pytest.skip("no transparent huge pages here: nothing is placed")
    monkeypatch.setattr(allocator, "ARENA_MIN_BYTES", 0)
    placed = []
    for _ in range(2):
        model, _ = load_model(tiny_dir, torch.float32, torch.device("cpu"), 256)
        model.plan_cache_dir = tmp_path   # the second load reuses the first's plan
        model.specialize_cpu("float")
        placed.append(model.cpu_weights_placed_bytes)
    assert placed[0] == placed[1] > 0
    assert allocator.weight_arena().placed_bytes >= sum(placed)
