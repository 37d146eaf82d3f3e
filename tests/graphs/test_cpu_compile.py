"""Compiled CPU decode programs (graphs/cpu_compile.py) with a real (tiny) model.

1. Real compilation (torch.compile / Inductor, two buckets): greedy tokens equal the eager
   runner's and transformers', padded rows write no KV, every decode step runs a program,
   and a warm start finds the programs in the on-disk cache.
2. The bookkeeping around compilation with the compiler stubbed out (fast): a bucket that
   fails to compile is dropped with its reason and runs eager; a program that fails on live
   traffic is dropped, never recompiled; reasons when compilation is off.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo
from structlog.testing import capture_logs

from tokenloom.actors.execution.model_runner import ModelRunner
from tokenloom.actors.messages import ExecuteBatch, NewSequence, ScheduledSequence
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.arith import cdiv
from tokenloom.config.load import load_config
from tokenloom.config.schema import ConfigError, GraphsConfig
from tokenloom.graphs import cpu_compile
from tokenloom.graphs import setup as graph_setup
from tokenloom.kernels.cpu.attention import load_cpu_decode_kernel, paged_decode_cpu
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.models.loader import load_model, load_spec

from tinymodel import VOCAB, build_tiny_model

BS = 8
NUM_BLOCKS = 64
MAX_LEN = 96
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

pytestmark = pytest.mark.skipif(load_cpu_decode_kernel() is None,
                                reason="the C++ decode kernel could not be built here")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile-tiny")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=7)
    return path


def _model(path):
    spec = load_spec(path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), spec.max_position_embeddings)
    model.set_decode_kernel(paged_decode_cpu)
    return model, spec


def _kv(spec) -> KVCache:
    return KVCache.allocate(spec.num_layers, NUM_BLOCKS, BS, spec.num_kv_heads, spec.head_dim,
                            torch.float32, "cpu")


def _drive(runner: ModelRunner, prompts, tables, steps: int, decode_sets):
    """Prefill every prompt (eager), then decode the listed sequences each step."""
    seqs = [ScheduledSequence(request_id=f"r{i}", token_ids=p, start_pos=0,
                              block_table=tables[i][: cdiv(len(p), BS)], sample=True,
                              new=NewSequence(prompt_token_ids=p, output_token_ids=[],
                                              sampling_params=GREEDY))
            for i, p in enumerate(prompts)]
    out = runner.execute(ExecuteBatch(step=0, sequences=seqs, num_decodes=0))
    tokens = {s.request_id: [s.token_id] for s in out.sampled}
    lens = {f"r{i}": len(p) for i, p in enumerate(prompts)}
    for step in range(steps):
        batch = []
        for i in decode_sets[step % len(decode_sets)]:
            rid, pos = f"r{i}", lens[f"r{i}"]
            batch.append(ScheduledSequence(request_id=rid, token_ids=[tokens[rid][-1]],
                                           start_pos=pos, block_table=tables[i][: pos // BS + 1],
                                           sample=True))
            lens[rid] += 1
        out = runner.execute(ExecuteBatch(step=step + 1, sequences=batch, num_decodes=len(batch)))
        for s in out.sampled:
            tokens[s.request_id].append(s.token_id)
    return tokens


def _pinned_kernel() -> str:
    from tokenloom.kernels.cpu import kernel_set
    return "small_gemm" if kernel_set.small_gemm_module() is not None else "mkl"


@pytest.fixture(autouse=True)
def _pinned_kernels(monkeypatch):
    """Every projection on one traceable kernel at every batch size (the C++ small-batch
    kernel, else MKL's matmul): which kernel a bucket's program calls must not depend on
    timings taken on a loaded machine (a bucket whose fastest measured kernel is oneDNN
    stays eager, which a test here would see as a missing program). The rule itself is
    tested with its own plan below."""
    from tokenloom.kernels.cpu import kernel_plan

    pinned = kernel_plan.Plan(((1 << 30, _pinned_kernel()),), {})
    monkeypatch.setattr(kernel_plan, "cached_plan", lambda *a, **k: pinned)


def _build(path, tmp_path, sizes=(1, 4)):
    model, spec = _model(path)
    kv = _kv(spec)
    cfg = GraphsConfig(cpu_compile=True, cpu_capture_sizes=list(sizes))
    with capture_logs() as events:
        dispatcher, programs = graph_setup.build_decode_graphs(
            cfg, model, kv, max_num_seqs=8, max_model_len=MAX_LEN, device=torch.device("cpu"),
            cache_dir=tmp_path)
    return model, spec, kv, dispatcher, programs, events


def test_compiled_programs_match_eager_and_transformers(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model, spec, kv, dispatcher, programs, events = _build(tiny_dir, tmp_path)
    assert programs is not None and programs.sizes == (1, 4), programs.failed
    assert dispatcher.table is not None and dispatcher.table.sizes == (1, 4)
    assert any("CPU decode programs: 2 buckets" in e["event"] for e in events)
    compiled = ModelRunner(model, kv, torch.device("cpu"), (2,), programs, dispatcher)
    eager_model, _ = _model(tiny_dir)
    eager = ModelRunner(eager_model, _kv(spec), torch.device("cpu"), (2,))

    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (13, 8, 30)]
    blocks = list(range(1, NUM_BLOCKS))
    rng.shuffle(blocks)
    tables = [blocks[i * 12:(i + 1) * 12] for i in range(len(prompts))]
    decode_sets = [[0, 1, 2], [0, 2], [1]]        # 3 -> bucket 4, 2 -> 4, 1 -> 1
    tok_c = _drive(compiled, prompts, tables, 9, decode_sets)
    tok_e = _drive(eager, prompts, tables, 9, decode_sets)
    assert tok_c == tok_e
    stats = compiled.graph_stats()
    assert stats.replays == 9 and stats.static_eager_runs == 0
    assert stats.graph_padded_rows > 0
    # Padded rows wrote nothing: block 0 is in no table and must still be all zeros.
    assert all((k[0] == 0).all() and (v[0] == 0).all() for k, v in zip(kv.key, kv.value))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompts[2]])
    n = len(tok_c["r2"])
    ref = hf.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))[0, len(prompts[2]):].tolist()
    assert tok_c["r2"] == ref

    # A warm start: the same model shape finds its programs in the on-disk cache.
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    _, _, _, _, warm, _ = _build(tiny_dir, tmp_path)
    assert warm is not None and warm.sizes == (1, 4), warm.failed
    assert counters["inductor"]["fxgraph_cache_hit"] >= 2, dict(counters["inductor"])
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
    # One compiled region per bucket serves both layers (they differ only in tensors).
    assert counters["stats"]["unique_graphs"] == 2


class _FakeCompile:
    """torch.compile stand-in: the program runs eagerly, optionally failing for some sizes."""

    def __init__(self, fail_sizes=()):
        self.fail_sizes = set(fail_sizes)

    def __call__(self, fn, **kwargs):
        def program(layer, m, *rest):    # the compiled region: one decoder layer
            if m.shape[0] in self.fail_sizes:
                raise RuntimeError(f"inductor failed for {m.shape[0]}")
            return fn(layer, m, *rest)
        return program


def test_a_bucket_that_fails_to_compile_runs_eager_with_its_reason(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_compile.torch, "compile", _FakeCompile(fail_sizes={4}))
    model, spec, kv, dispatcher, programs, events = _build(tiny_dir, tmp_path, sizes=(1, 2, 4))
    assert programs.sizes == (1, 2) and "inductor failed for 4" in programs.failed[4]
    # The dispatcher only knows the compiled buckets: 3 rows go eager, not to bucket 4.
    assert dispatcher.table.sizes == (1, 2)
    assert dispatcher.decide(3, 3, 3).mode == "eager"
    warned = [e for e in events if e["log_level"] == "warning"]
    assert warned and "batch 4" in warned[0]["event"] and "inductor failed" in warned[0]["reason"]


def test_a_program_failing_on_live_traffic_is_dropped_not_recompiled(tiny_dir, tmp_path,
                                                                     monkeypatch):
    fake = _FakeCompile()
    monkeypatch.setattr(cpu_compile.torch, "compile", fake)
    model, spec, kv, dispatcher, programs, _ = _build(tiny_dir, tmp_path, sizes=(1, 2))
    runner = ModelRunner(model, kv, torch.device("cpu"), (2,), programs, dispatcher)
    fake.fail_sizes.add(2)     # e.g. a guard that would need a recompile
    prompts = [[5, 6, 7], [8, 9]]
    tables = [[1, 2], [3, 4]]
    tokens = _drive(runner, prompts, tables, 3, [[0, 1]])
    assert all(len(t) == 4 for t in tokens.values())
    assert programs.sizes == (1,) and "inductor failed for 2" in programs.failed[2]
    assert programs.num_static_eager == 3 and programs.num_replays == 0


def test_reasons_when_cpu_programs_are_off(tiny_dir):
    model, spec = _model(tiny_dir)
    kv = _kv(spec)
    cpu = torch.device("cpu")
    for cfg, reason in ((GraphsConfig(cpu_compile=False), "graphs.cpu_compile is off"),
                        (GraphsConfig(enforce_eager=True), "graphs.enforce_eager"),
                        (GraphsConfig(cpu_compile=True, cpu_capture_sizes=[32]),
                         "no graphs.cpu_capture_sizes")):
        d, g = graph_setup.build_decode_graphs(cfg, model, kv, max_num_seqs=8, max_model_len=64,
                                               device=cpu)
        assert g is None and d.table is None and reason in d.disabled_reason
    model.set_decode_kernel(None)
    d, g = graph_setup.build_decode_graphs(GraphsConfig(cpu_compile=True), model, kv,
                                           max_num_seqs=8, max_model_len=64, device=cpu)
    assert g is None and "C++ decode kernel" in d.disabled_reason


def test_cpu_capture_sizes_are_validated():
    with pytest.raises(ConfigError, match="graphs.cpu_capture_sizes must be integers in 1..4096"):
        load_config(overrides={"graphs.cpu_capture_sizes": [0, 4]}, env={})
    assert load_config(env={"TOKENLOOM_GRAPHS__CPU_COMPILE": "true"}).graphs.cpu_compile is True
    assert load_config(env={"TOKENLOOM_GRAPHS__CPU_COMPILE": "false"}).graphs.cpu_compile is False


def test_cache_key_follows_dtype_and_cpu(tiny_dir, monkeypatch):
    model, spec = _model(tiny_dir)
    kv = _kv(spec)
    key = cpu_compile.cache_key(model, kv)
    assert key == cpu_compile.cache_key(model, kv)
    kv16 = KVCache.allocate(spec.num_layers, NUM_BLOCKS, BS, spec.num_kv_heads, spec.head_dim,
                            torch.bfloat16, "cpu")
    assert cpu_compile.cache_key(model, kv16) != key
    import dataclasses

    from tokenloom.kernels.cpu import features as cpu_features
    other = dataclasses.replace(cpu_features.detect(), torch_capability="ANOTHER_CPU")
    monkeypatch.setattr(cpu_features, "detect", lambda: other)
    assert cpu_compile.cache_key(model, kv) != key


def test_bf16_programs_round_like_eager(tiny_dir, tmp_path):
    """In bf16 a program must round every intermediate where eager does (Inductor's fused
    loops would otherwise keep fp32 in between): its logits equal the eager path's."""
    spec = load_spec(tiny_dir)
    model, _ = load_model(tiny_dir, torch.bfloat16, torch.device("cpu"),
                          spec.max_position_embeddings)
    model.set_decode_kernel(paged_decode_cpu)
    kv = KVCache.allocate(spec.num_layers, NUM_BLOCKS, BS, spec.num_kv_heads, spec.head_dim,
                          torch.bfloat16, "cpu")
    kv.pool.normal_(generator=torch.Generator().manual_seed(0))
    _, programs = graph_setup.build_decode_graphs(
        GraphsConfig(cpu_compile=True, cpu_capture_sizes=[2]), model, kv, max_num_seqs=8,
        max_model_len=MAX_LEN, device=torch.device("cpu"), cache_dir=tmp_path)
    assert programs.sizes == (2,), programs.failed
    seqs = [ScheduledSequence(request_id=f"r{i}", token_ids=[7 + i], start_pos=20 + i,
                              block_table=[3 * i + 1, 3 * i + 2, 3 * i + 3], sample=True)
            for i in range(2)]
    compiled = programs.run(seqs, 2).clone()
    assert programs.num_replays == 1
    if _pinned_kernel() == "small_gemm":   # an opaque op: the program rounds as eager does
        assert torch.equal(compiled, programs._eager(2))
    else:   # Inductor's code around MKL's bf16 matmul can round a few bf16 steps apart
        assert torch.allclose(compiled, programs._eager(2), rtol=2 ** -5, atol=2 ** -5)


def test_buckets_whose_fastest_kernel_cannot_be_compiled_stay_eager(tiny_dir, tmp_path,
                                                                     monkeypatch):
    """A bucket compiles only when its program would call the kernels measured fastest for
    it: where that is oneDNN (untraceable), the eager path is faster, so it stays eager."""
    from tokenloom.kernels.cpu import kernel_plan

    forced = kernel_plan.Plan(((1, "mkl"), (8, "onednn")),
                             {1: {"mkl": 1.0, "onednn": 2.0}, 8: {"mkl": 3.0, "onednn": 1.0}})
    monkeypatch.setattr(kernel_plan, "cached_plan", lambda *a, **k: forced)
    monkeypatch.setattr(cpu_compile.torch, "compile", _FakeCompile())
    model, spec, kv, dispatcher, programs, events = _build(tiny_dir, tmp_path, sizes=(1, 4))
    assert programs.sizes == (1,) and dispatcher.table.sizes == (1,)
    assert any("batch sizes [4] stay eager" in e["event"] for e in events)


def test_a_bucket_whose_fastest_kernel_is_an_avx2_tile_compiles_and_matches_eager(
        tiny_dir, tmp_path, monkeypatch):
    """tile_gemm_f32 registers a shape function: a bucket whose plan picks it compiles
    (it is not left eager), and the program's logits are eager's (the same opaque kernel;
    Inductor's fused fp32 code around it may differ in the last bits)."""
    from tokenloom.kernels.cpu import kernel_plan

    if not kernel_plan._available("tile_gemm_f32"):
        pytest.skip("tile_gemm_f32 not built here (no AVX2 + FMA)")
    pinned = kernel_plan.Plan(((1 << 30, "tile_gemm_f32"),), {})
    monkeypatch.setattr(kernel_plan, "cached_plan", lambda *a, **k: pinned)
    model, spec = _model(tiny_dir)
    kv = _kv(spec)
    kv.pool.normal_(generator=torch.Generator().manual_seed(0))
    _, programs = graph_setup.build_decode_graphs(
        GraphsConfig(cpu_compile=True, cpu_capture_sizes=[2]), model, kv, max_num_seqs=8,
        max_model_len=MAX_LEN, device=torch.device("cpu"), cache_dir=tmp_path)
    assert programs is not None and programs.sizes == (2,), programs.failed
    assert model.layers[0].mlp.down_proj.kernel_for(2) == "tile_gemm_f32"
    seqs = [ScheduledSequence(request_id=f"r{i}", token_ids=[7 + i], start_pos=20 + i,
                              block_table=[3 * i + 1, 3 * i + 2, 3 * i + 3], sample=True)
            for i in range(2)]
    compiled = programs.run(seqs, 2).clone()
    assert programs.num_replays == 1
    torch.testing.assert_close(compiled, programs._eager(2), rtol=1e-5, atol=1e-5)
