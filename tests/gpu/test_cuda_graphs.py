"""CUDA-only checks of the graph path and the Triton kernels (run by `make gpu-check`).

Skipped, with the reason, where no CUDA GPU exists. Models are random (built on the GPU
machine, which has no network):
1. graph replay equals eager logits for every bucket, padded and exact batch sizes;
2. greedy output through the engine with graphs on equals transformers' (tiny model);
3. capture memory stays within graphs.memory_budget_bytes, and an impossible budget falls
   back to eager with a reason;
4. capture is closed after start-up: an accidental capture raises;
5. the Triton decode kernel agrees with the torch reference at 8k context in bf16;
6. piecewise graphs (mixed prefill+decode steps) replay to the plain forward's logits, for
   chunks that start mid-prompt and padded token buckets, and the engine replays them.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tokenloom.arith import cdiv

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (none here); run `make gpu-check` on a GPU host"),
]

BS = 16


def _setup(shape: str, dtype: torch.dtype, sizes, max_context: int = 256, seed: int = 0):
    from tokenloom.graphs.buffers import DecodeBuffers
    from tokenloom.graphs.capture import DecodeGraphs
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.models.random_model import SHAPES, random_model
    from tokenloom.kernels.gpu.triton_attention import make_decode_kernel, store_kv_triton

    spec = SHAPES[shape]
    model = random_model(spec, dtype, "cuda", max_positions=max_context + BS, seed=seed)
    model.set_decode_kernel(make_decode_kernel(spec))   # split sized per step by the SMs
    model.set_kv_store_kernel(store_kv_triton)
    blocks_per_seq = cdiv(max_context, BS)
    num_blocks = max(sizes) * blocks_per_seq + 1
    kv = KVCache.allocate(spec.num_layers, num_blocks, BS, spec.num_kv_heads, spec.head_dim,
                          dtype, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for k, v in zip(kv.key, kv.value):
        k.normal_(generator=g)
        v.normal_(generator=g)
    buffers = DecodeBuffers(max(sizes), blocks_per_seq, BS, spec.vocab_size, "cuda")
    return spec, model, kv, DecodeGraphs(model, kv, buffers), blocks_per_seq


def _decode_seqs(n: int, blocks_per_seq: int, max_context: int, vocab: int, rng: random.Random):
    seqs = []
    for i in range(n):
        pos = rng.randrange(0, max_context)
        table = [1 + i * blocks_per_seq + j for j in range(pos // BS + 1)]
        seqs.append(SimpleNamespace(request_id=f"r{i}", token_ids=[rng.randrange(vocab)],
                                    start_pos=pos, block_table=table, sample=True))
    return seqs


def _eager_logits(model, kv, seqs):
    from tokenloom.actors.execution.batch_inputs import build_batch_inputs

    batch = SimpleNamespace(sequences=seqs, num_decodes=len(seqs))
    inputs = build_batch_inputs(batch, BS, torch.device("cuda"))
    return model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.logits_indices)


@pytest.mark.parametrize("shape,dtype,tol", [("tiny", torch.float32, 1e-4),
                                             ("smollm2-135m", torch.bfloat16, 5e-2)])
def test_graph_replay_matches_eager_for_every_bucket(shape, dtype, tol):
    from tokenloom.graphs.buckets import PaddedSizeTable, default_capture_sizes

    sizes = default_capture_sizes(64)
    spec, model, kv, graphs, bps = _setup(shape, dtype, sizes)
    graphs.capture(sizes, memory_budget_bytes=8 << 30, progress=False)
    assert graphs.sizes == sizes
    table = PaddedSizeTable(sizes)
    rng = random.Random(0)
    for n in sorted({s for s in sizes} | {s - 1 for s in sizes if s > 1}):
        seqs = _decode_seqs(n, bps, 250, spec.vocab_size, rng)
        want = _eager_logits(model, kv, seqs)
        got = graphs.run(seqs, table.padded(n))[:n]
        scale = want.abs().max().item()
        diff = (got - want).abs().max().item()
        assert diff <= tol * max(1.0, scale), f"batch {n} (bucket {table.padded(n)}): {diff}"
        assert torch.equal(got.argmax(-1), want.argmax(-1)) or dtype != torch.float32


def test_capture_memory_within_budget_and_over_budget_falls_back():
    from structlog.testing import capture_logs

    from tokenloom.config.schema import GraphsConfig
    from tokenloom.graphs import setup as graph_setup
    from tokenloom.graphs.buckets import default_capture_sizes
    from tokenloom.graphs.capture import CaptureError

    budget = GraphsConfig().memory_budget_bytes
    sizes = default_capture_sizes(256)
    spec, model, kv, graphs, _ = _setup("smollm2-135m", torch.bfloat16, sizes, max_context=2048)
    graphs.capture(sizes, memory_budget_bytes=budget, progress=False)
    assert 0 <= graphs.capture_bytes <= budget
    print(f"capture of {len(sizes)} graphs: {graphs.capture_bytes / 2**20:.0f} MiB, "
          f"{graphs.capture_seconds:.1f} s")
    with pytest.raises(CaptureError, match="over the budget"):
        _setup("tiny", torch.float32, (1, 2))[3].capture((1, 2), memory_budget_bytes=0,
                                                          progress=False)
    with capture_logs() as events:
        d, g = graph_setup.build_decode_graphs(GraphsConfig(memory_budget_bytes=0), model, kv,
                                               max_num_seqs=8, max_model_len=256,
                                               device=torch.device("cuda"))
    assert g is None and "over the budget" in d.disabled_reason
    assert any(e["logger_name"] == "tokenloom.startup" and "decode runs eager" in e["event"]
               for e in events), events


def test_accidental_capture_raises_after_start_up():
    from tokenloom.graphs.capture import CaptureClosedError

    *_, graphs, _ = _setup("tiny", torch.float32, (1, 2))
    graphs.capture((1, 2), memory_budget_bytes=1 << 30, progress=False)
    with pytest.raises(CaptureClosedError):
        graphs.capture_one(1)


def test_triton_decode_matches_reference_at_8k_bf16():
    from tokenloom.kernels.attention import decode_attention
    from tokenloom.kernels.models.random_model import SHAPES
    from tokenloom.kernels.gpu.triton_attention import make_decode_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.tensor([8192, 1, 4097, 16, 17, 8000], device="cuda")
    nb = 8192 // BS
    kc = torch.randn(nb * len(lens) + 1, BS, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    tables = torch.randperm(kc.shape[0], device="cuda", generator=g)[: nb * len(lens)].view(len(lens), nb)
    q = torch.randn(len(lens), 32, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, 8192, 128 ** -0.5)
    out = make_decode_kernel(SHAPES["llama3-8b"])(q, kc, vc, tables, lens, 8192, 128 ** -0.5)
    assert (out.float() - ref).abs().max().item() < 2e-2


def test_greedy_matches_transformers_with_graphs_on(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("msgspec")
    from tinymodel import VOCAB, build_tiny_model
    from transformers import AutoModelForCausalLM

    from tokenloom import LLM, SamplingParams

    build_tiny_model(tmp_path / "m", "LlamaConfig", dict(num_hidden_layers=3), seed=1)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (130, 7, 33, 64, 5)]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf.generate(ids, do_sample=False, max_new_tokens=16, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))
        expected.append(out[0, len(p):].tolist())
    # A token budget of 64: the 130-token prompt is prefilled in chunks beside decodes.
    llm = LLM(model=str(tmp_path / "m"), quiet=True, device="cuda", dtype="float32",
              cache_dir=str(tmp_path / "cache"), block_size=16, max_num_seqs=8,
              num_blocks=128, max_num_batched_tokens=64)
    try:
        assert llm.engine.info.attention_backend == "triton"
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True))]
        stats = llm.graph_stats()
    finally:
        llm.close()
    assert stats.graph_steps > 0 and stats.replays > 0, stats
    assert stats.piecewise_steps > 0 and stats.piecewise_replays > 0, stats
    assert not stats.eager_reasons, stats
    assert got == expected


@pytest.mark.parametrize("shape,dtype,tol", [("tiny", torch.float32, 1e-4),
                                             ("smollm2-135m", torch.bfloat16, 5e-2)])
def test_piecewise_replay_matches_the_plain_forward(shape, dtype, tol):
    from tokenloom.actors.execution.batch_inputs import build_batch_inputs
    from tokenloom.graphs.buckets import PaddedSizeTable, default_token_sizes
    from tokenloom.graphs.piecewise import PiecewiseBuffers, PiecewiseGraphs
    from tokenloom.kernels.gpu import triton_fused as tf

    sizes = default_token_sizes(256)
    spec, model, kv, graphs, bps = _setup(shape, dtype, (1, 2, 4, 8))
    model.set_fused_kernels(tf.rms_norm_triton, tf.silu_mul_triton, tf.rope_store_triton)
    graphs.capture((1, 2, 4, 8), memory_budget_bytes=8 << 30, progress=False)
    pieces = PiecewiseGraphs(model, kv, PiecewiseBuffers(model, max(sizes), "cuda"),
                             pool=graphs.pool)
    pieces.capture(sizes, memory_budget_bytes=8 << 30, progress=False)
    assert pieces.sizes == sizes and all(len(g) == spec.num_layers + 1
                                         for g in pieces.graphs.values())
    print(f"piecewise capture of {len(sizes)} buckets x {spec.num_layers + 1} pieces: "
          f"{pieces.capture_bytes / 2**20:.0f} MiB, {pieces.capture_seconds:.1f} s")
    table = PaddedSizeTable(sizes)
    rng = random.Random(2)
    for trial in range(12):
        # 0-6 decodes, then 1-3 chunks, some starting mid-prompt (after cached blocks).
        seqs, nd, blocks = [], rng.randrange(0, 7), iter(range(1, kv.key[0].shape[0]))
        for i in range(nd + rng.randrange(1, 4)):
            start = rng.randrange(0, 120)   # at most 10 blocks a row: 9 rows fit the pool
            n = 1 if i < nd else rng.randrange(1, 40)
            table_ = [next(blocks) for _ in range(cdiv(start + n, BS))]
            seqs.append(SimpleNamespace(request_id=f"r{i}", sample=True, start_pos=start,
                                        token_ids=[rng.randrange(spec.vocab_size)
                                                   for _ in range(n)], block_table=table_))
        inp = build_batch_inputs(SimpleNamespace(sequences=seqs, num_decodes=nd), BS,
                                 torch.device("cuda"), with_decode_mask=False)
        t = inp.input_ids.shape[0]
        want = model(inp.input_ids, inp.positions, kv, inp.meta, inp.logits_indices)
        before = pieces.num_replays
        got = pieces.run(inp.input_ids, inp.positions, inp.meta, inp.logits_indices,
                         table.padded(t))
        assert pieces.num_replays == before + 1
        diff = (got - want).abs().max().item()
        assert diff <= tol * max(1.0, want.abs().max().item()), f"{t} tokens: {diff}"
