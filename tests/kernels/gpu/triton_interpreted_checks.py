"""Checks of the Triton paged-attention decode and KV-store kernels against the torch
reference, on CPU under the Triton interpreter.

Not collected on its own (no `test_` prefix): test_triton_attention.py runs this file in a
subprocess with TRITON_INTERPRET=1, because the interpreter must be chosen before `triton`
is first imported and the variable must not leak into the rest of the suite. Shapes are small
because the interpreter runs every program instance in Python.
"""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_attention.py"

import tokenloom.kernels.gpu.triton_attention as _tk  # noqa: E402
from tokenloom.arith import cdiv  # noqa: E402
from tokenloom.kernels.attention import decode_attention  # noqa: E402
from tokenloom.kernels.kv_store import store_kv  # noqa: E402


@pytest.fixture(scope="module")
def tk():
    return _tk


def _case(heads, kv_heads, head_dim, block_size, lens, dtype, seed, num_blocks=None):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int64)
    max_blocks = cdiv(int(lens.max()), block_size)
    num_blocks = num_blocks or max_blocks * len(lens) + 3
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # Each row's blocks are a random, non-contiguous pick of the pool.
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: max_blocks * len(lens)].view(len(lens), max_blocks).clone()
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, lens


CASES = [  # (heads, kv_heads, head_dim, block_size, context lengths)
    # GQA ratio 1, block boundaries: 1, a full block, one past it, two blocks minus one.
    (2, 2, 64, 16, [1, 16, 17, 31]),
    # ratio 3 (SmolLM2 grouping), block size 32, up to 2,000 tokens (several partitions).
    (3, 1, 64, 32, [2000, 32, 33, 513]),
    # ratio 8, head dim 128, partition boundaries (partition 512 -> 512, 513, 1024).
    (8, 1, 128, 16, [512, 513, 1024, 5]),
    # ratio 8 with block size 32 and head dim 128: contexts 1 to 2,000.
    (16, 2, 128, 32, [2000, 1, 64, 65]),
    # SmolLM2's exact grouping (9 heads over 3), block size 16, long and short rows mixed.
    (9, 3, 64, 16, [1999, 257, 16]),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,lens", CASES)
def test_decode_matches_reference(tk, heads, kv_heads, head_dim, block_size, lens):
    q, kc, vc, tables, lens_t = _case(heads, kv_heads, head_dim, block_size, lens, torch.float32,
                                      seed=heads * 100 + head_dim)
    max_ctx = int(lens_t.max())
    scale = head_dim ** -0.5
    ref = decode_attention(q, kc, vc, tables, lens_t, max_ctx, scale)
    out = tk.paged_decode_triton(q, kc, vc, tables, lens_t, max_ctx, scale, block_n=128)
    assert out.shape == q.shape and out.dtype == q.dtype
    diff = (out - ref).abs().max().item()
    assert diff < 1e-5, f"max abs diff {diff}"


def test_partition_count_does_not_change_results(tk):
    """A graph captured for a longer max_context (more, mostly empty partitions) gives the
    same answer as an eager call sized to the batch."""
    q, kc, vc, tables, lens = _case(4, 2, 64, 16, [600, 40], torch.float32, seed=7)
    wide = torch.cat([tables, torch.zeros(2, 30, dtype=torch.int64)], dim=1)  # padded table
    a = tk.paged_decode_triton(q, kc, vc, tables, lens, 600, 0.125, partition=256, block_n=128)
    b = tk.paged_decode_triton(q, kc, vc, wide, lens, wide.shape[1] * 16, 0.125, partition=256,
                               block_n=128)
    assert torch.equal(a, b)


def test_padded_rows_are_finite_and_do_not_touch_real_rows(tk):
    """Graph padding rows: context length 1 over block 0; real rows unaffected."""
    q, kc, vc, tables, lens = _case(6, 2, 64, 32, [70, 1, 1], torch.float32, seed=9)
    tables[1:] = 0
    out = tk.paged_decode_triton(q, kc, vc, tables, lens, 96, 0.125, block_n=64)
    ref = decode_attention(q[:1], kc, vc, tables[:1], lens[:1], 70, 0.125)
    assert torch.isfinite(out).all()
    assert (out[:1] - ref).abs().max().item() < 1e-5
    # One visible key: the output is exactly that key's value.
    expected = vc[0, 0].repeat_interleave(3, dim=0)
    assert torch.allclose(out[1], expected, atol=1e-6)


def test_bf16(tk):
    q, kc, vc, tables, lens = _case(8, 2, 64, 16, [300, 17], torch.bfloat16, seed=11)
    ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens, 300, 0.125)
    out = tk.paged_decode_triton(q, kc, vc, tables, lens, 300, 0.125, block_n=64)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("partition", [64, 128, 512, 2048])
def test_every_partition_matches_the_reference_with_padded_rows(tk, partition):
    """Partitions the split rule can pick (64 tokens: 21 partitions, more than one reduce
    chunk), with graph padding rows (context 1 over block 0) mixed in."""
    q, kc, vc, tables, lens = _case(8, 2, 64, 16, [1300, 1, 65, 1], torch.float32, seed=13)
    tables[[1, 3]] = 0
    ref = decode_attention(q, kc, vc, tables, lens, 1300, 0.125)
    out = tk.paged_decode_triton(q, kc, vc, tables, lens, 1300, 0.125, partition=partition)
    assert (out - ref).abs().max().item() < 1e-5


def test_split_decode_sizes_per_call_and_matches_the_reference(tk):
    """SplitDecode on a 4-SM rule: eager calls and the graph rule (a wide table, as captured)
    pick different partitions; both equal the reference, and the graph call equals the
    same partition launched over the narrow table bit for bit (empty partitions exit)."""
    from tokenloom.kernels.gpu.decode_split import SplitRule

    split = tk.SplitDecode(SplitRule(heads=8, kv_heads=2, head_dim=64, sm_count=4,
                                     reference_context=256))
    q, kc, vc, tables, lens = _case(8, 2, 64, 16, [700, 40, 1], torch.float32, seed=17)
    ref = decode_attention(q, kc, vc, tables, lens, 700, 0.125)
    eager = split.variant(3, 700, capturing=False)
    assert not eager.direct and eager.partition == 256     # 3 rows x 2 heads -> 2 parts
    out = split(q, kc, vc, tables, lens, 700, 0.125)
    assert (out - ref).abs().max().item() < 1e-5
    wide = torch.cat([tables, torch.zeros(3, 84, dtype=torch.int64)], dim=1)   # 2048 tokens
    graph = split.variant(3, 2048, capturing=True)
    assert graph.partition == 128 and graph != eager      # sized for 256 tokens, not 2048
    got = tk._launch(q, kc, vc, wide, lens, 0.125, graph.partition, 2048 // 128, 64)
    assert (got - ref).abs().max().item() < 1e-5
    assert torch.equal(got, tk.paged_decode_triton(q, kc, vc, tables, lens, 700, 0.125,
                                                   partition=128))


def test_store_kv_skips_negative_slots(tk):
    g = torch.Generator().manual_seed(3)
    num_blocks, bs, kvh, d = 4, 16, 3, 64
    kc = torch.randn(num_blocks, bs, kvh, d, generator=g)
    vc = torch.randn(num_blocks, bs, kvh, d, generator=g)
    # Keys sliced out of a wider fused tensor, as the model does (row stride > KVH * D).
    fused = torch.randn(5, 2 * kvh, d, generator=g)
    key, value = fused[:, :kvh], fused[:, kvh:]
    slots = torch.tensor([17, -1, 0, 63, -1])
    ref_k, ref_v = kc.clone(), vc.clone()
    store_kv(key, value, ref_k, ref_v, slots, has_skip=True)
    tk.store_kv_triton(key, value, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_non_contiguous_q_as_the_model_passes_it(tk):
    q, kc, vc, tables, lens = _case(4, 2, 64, 16, [40, 3], torch.float32, seed=13)
    fused = torch.cat([q, torch.randn(2, 2, 64)], dim=1)      # [B, H + KVH, D]
    qv = fused[:, :4]
    assert not qv.is_contiguous()
    out = tk.paged_decode_triton(qv, kc, vc, tables, lens, 40, 0.125, block_n=64)
    ref = decode_attention(q, kc, vc, tables, lens, 40, 0.125)
    assert (out - ref).abs().max().item() < 1e-5


def test_model_forward_with_triton_kernels(tk):
    """The tiny model with Triton decode + store kernels equals the reference forward:
    1. a mixed batch (two decodes and a prefill chunk); 2. a padded static-buffer decode
    step (graph inputs) whose padded rows the store kernel skips."""
    from types import SimpleNamespace

    from tokenloom.actors.execution.batch_inputs import build_batch_inputs
    from tokenloom.graphs.buffers import DecodeBuffers
    from tokenloom.graphs.capture import DecodeGraphs
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.models.random_model import SHAPES, random_model

    spec = SHAPES["tiny"]
    torch.manual_seed(0)
    ref_model = random_model(spec, torch.float32, "cpu", 256, seed=1)
    tri_model = random_model(spec, torch.float32, "cpu", 256, seed=1)
    tri_model.set_decode_kernel(tk.make_decode_kernel(spec, sms=4))
    tri_model.set_kv_store_kernel(tk.store_kv_triton)

    def kv():
        return KVCache.allocate(spec.num_layers, 40, 16, spec.num_kv_heads, spec.head_dim,
                                torch.float32, "cpu")

    kv_ref, kv_tri = kv(), kv()

    def seq(rid, ids, start, table):
        return SimpleNamespace(request_id=rid, token_ids=ids, start_pos=start, block_table=table,
                               sample=True)

    def run(model, cache, seqs, nd):
        inp = build_batch_inputs(SimpleNamespace(sequences=seqs, num_decodes=nd), 16,
                                 torch.device("cpu"))
        return model(inp.input_ids, inp.positions, cache, inp.meta, inp.logits_indices)

    prompts = {"a": list(range(3, 40)), "b": list(range(50, 67)), "c": list(range(100, 130))}
    tables = {"a": [5, 9, 2], "b": [7, 1], "c": [11, 12]}
    for model, cache in ((ref_model, kv_ref), (tri_model, kv_tri)):
        run(model, cache, [seq("a", prompts["a"], 0, tables["a"]),
                           seq("b", prompts["b"], 0, tables["b"])], 0)
    mixed = [seq("a", [7], 37, tables["a"]), seq("b", [8], 17, tables["b"]),
             seq("c", prompts["c"], 0, tables["c"])]
    want, got = run(ref_model, kv_ref, mixed, 2), run(tri_model, kv_tri, mixed, 2)
    assert (want - got).abs().max().item() < 1e-4
    step = [seq("a", [9], 38, tables["a"]), seq("c", [10], 30, tables["c"])]
    want = run(ref_model, kv_ref, step, 2)
    graphs = DecodeGraphs(tri_model, kv_tri, DecodeBuffers(4, 4, 16, spec.vocab_size, "cpu"))
    got = graphs.run(step, 4)[:2]
    assert (want - got).abs().max().item() < 1e-4
    # The two padded rows wrote nowhere: both pools hold the same values everywhere (a
    # write to slot -1 would land in the neighbouring layer's last block).
    for a, b in zip(kv_ref.key + kv_ref.value, kv_tri.key + kv_tri.value):
        assert (a - b).abs().max().item() < 1e-5


# -- a layer's options: a sliding window and soft-capped scores ---------------------------

WINDOW_OPTIONS = [(24, None), (37, None), (None, 2.0), (37, 2.0), (1, None)]


def _behind_window(tables, lens, window, block_size):
    """A hybrid layout's tables: entries of blocks wholly behind each row's window point
    at block 0, here filled with NaN by the caller."""
    tables = tables.clone()
    if window is not None:
        for row, n in enumerate(lens.tolist()):
            tables[row, : max(0, n - window) // block_size] = 0
    return tables


@pytest.mark.parametrize("window,softcap", WINDOW_OPTIONS)
@pytest.mark.parametrize("partition", [32, 128])
def test_window_and_softcap_match_the_reference(tk, window, softcap, partition):
    """Contexts shorter than, at and past the window, several partitions a row (32 tokens)
    or one; the keys behind the window are never read (block 0 is NaN there); the
    reference reads the same tables over a finite pool."""
    q, kc, vc, tables, lens = _case(4, 2, 32, 16, [1, 23, 24, 25, 70, 130], torch.float32,
                                    seed=23)
    tables = _behind_window(tables + 1, lens, window, 16)   # block 0: only as the null block
    kc, vc = torch.cat([kc[:1], kc]), torch.cat([vc[:1], vc])
    ref = decode_attention(q, kc, vc, tables, lens, 130, 0.2, window=window, softcap=softcap)
    kc[0], vc[0] = float("nan"), float("nan")
    out = tk.paged_decode_triton(q, kc, vc, tables, lens, 130, 0.2, partition=partition,
                                 block_n=32, window=window, softcap=softcap)
    assert (out - ref).abs().max().item() < 1e-5


def test_window_and_softcap_over_a_quantized_cache(tk):
    """The quantized variant takes the same options (int8 K and V, NaN scales in block 0)."""
    from tokenloom.kernels.kv_quant import FORMATS
    from tokenloom.kernels.kv_store import KVCache

    g = torch.Generator().manual_seed(29)
    kv = KVCache.allocate(1, 12, 16, 2, 32, torch.float32, "cpu", FORMATS["int8"],
                          FORMATS["int8"])
    n = 12 * 16
    store_kv(torch.randn(n, 2, 32, generator=g), torch.randn(n, 2, 32, generator=g),
             kv.key[0], kv.value[0], torch.randperm(n, generator=g))
    lens = torch.tensor([5, 40, 90])
    tables = torch.stack([torch.randperm(11, generator=g)[:6] + 1 for _ in range(3)])
    tables = _behind_window(tables, lens, 37, 16)
    q = torch.randn(3, 4, 32, generator=g)
    ref = decode_attention(q, kv.key[0], kv.value[0], tables, lens, 90, 0.2, window=37,
                           softcap=2.0)
    kv.key[0].scale[0] = float("nan")
    kv.value[0].scale[0] = float("nan")
    out = tk.paged_decode_triton(q, kv.key[0], kv.value[0], tables, lens, 90, 0.2, partition=32,
                                 block_n=32, window=37, softcap=2.0)
    assert (out - ref).abs().max().item() < 1e-5


def test_split_decode_takes_the_options_in_a_graph_sized_grid(tk):
    """SplitDecode declares the options (kernel_serves); over a wide table, as a captured
    graph launches it, the windowed rows give the eager call's result bit for bit."""
    from tokenloom.kernels.gpu.decode_split import SplitRule

    split = tk.SplitDecode(SplitRule(heads=4, kv_heads=2, head_dim=32, sm_count=4,
                                     reference_context=64))
    assert set(split.options) == set(tk.paged_decode_triton.options) == {"window", "softcap"}
    q, kc, vc, tables, lens = _case(4, 2, 32, 16, [100, 9], torch.float32, seed=31)
    ref = decode_attention(q, kc, vc, tables, lens, 100, 0.2, window=24, softcap=2.0)
    out = split(q, kc, vc, tables, lens, 100, 0.2, window=24, softcap=2.0)
    assert (out - ref).abs().max().item() < 1e-5
    wide = torch.cat([tables, torch.zeros(2, 9, dtype=torch.int64)], dim=1)
    graph = split.variant(2, 256, capturing=True)
    got = tk._launch(q, kc, vc, wide, lens, 0.2, graph.partition, cdiv(256, graph.partition),
                     split.rule.block_n, window=24, softcap=2.0)
    assert torch.equal(got, tk.paged_decode_triton(q, kc, vc, tables, lens, 100, 0.2,
                                                   partition=graph.partition,
                                                   block_n=split.rule.block_n, window=24,
                                                   softcap=2.0))
