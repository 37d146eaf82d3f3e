"""Mixed prefill+decode steps (benchmarks/mixed_step.py measures their cost):
1. a continuation chunk's mask is built once per step and is exactly the per-layer one;
2. a step mixing decodes, a fresh prompt and a continuation chunk computes what the same
   sequences compute in separate steps, with the torch reference decode and the C++ kernel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenloom.actors.execution.batch_inputs import build_batch_inputs
from tokenloom.kernels.attention import (
    chunk_mask,
    gather_context,
    prefill_attention,
    with_chunk_masks,
)
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
class Batch:  # likewise for messages.ExecuteBatch
    sequences: list[Seq]
    num_decodes: int


@pytest.mark.parametrize("start,n", [(1, 1), (5, 3), (16, 16), (40, 7)])
def test_chunk_mask_lets_each_query_see_up_to_its_own_position(start, n):
    mask = chunk_mask(start, n, torch.float32, torch.device("cpu"))
    assert mask.shape == (n, start + n)
    visible = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    assert torch.equal(mask == 0, visible)
    assert torch.isinf(mask[~visible]).all() and (mask[~visible] < 0).all()


def _reference(q, k, v, start, scale):
    """Plain softmax attention, GQA by repeating K/V. q: [n, H, D]; k, v: [ctx, KVH, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_continuation_chunk_with_the_step_mask_is_identical(dtype):
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(40, BLOCK, 3, 64, generator=g).to(dtype)
    vc = torch.randn(40, BLOCK, 3, 64, generator=g).to(dtype)
    table = torch.randperm(40, generator=g)[:13]
    start, n = 77, 23                       # context 100: 13 blocks, the last one partial
    q = torch.randn(n, 9, 64, generator=g).to(dtype)
    built = prefill_attention(q, kc, vc, table, start, 0.125)
    given = prefill_attention(q, kc, vc, table, start, 0.125, None,
                              chunk_mask(start, n, dtype, q.device))
    assert torch.equal(built, given)
    k, v = gather_context(kc, table)[: start + n], gather_context(vc, table)[: start + n]
    ref = _reference(q.float(), k.float(), v.float(), start, 0.125)
    assert (built.float() - ref).abs().max().item() < (1e-5 if dtype == torch.float32 else 3e-2)


def _meta(seqs, num_decodes):
    return build_batch_inputs(Batch(seqs, num_decodes), BLOCK, torch.device("cpu")).meta


def test_masks_are_built_once_per_step_for_continuation_chunks_only():
    fresh_only = _meta([Seq("d", [1], 9, [0, 1]), Seq("p", [1] * 5, 0, [2])], 1)
    assert with_chunk_masks(fresh_only, torch.float32) is fresh_only   # nothing to build
    meta = _meta([Seq("p", [1] * 5, 0, [2]), Seq("c", [1] * 4, 10, [3, 4])], 0)
    out = with_chunk_masks(meta, torch.bfloat16)
    fresh, cont = out.prefills
    assert fresh.mask is None
    assert cont.mask.dtype == torch.bfloat16 and cont.mask.shape == (4, 14)
    assert with_chunk_masks(out, torch.bfloat16) is out                 # already built
    assert meta.prefills[1].mask is None                                # the input is untouched


@pytest.fixture(scope="module")
def tiny():
    spec = SHAPES["tiny"]
    return spec, random_model(spec, torch.float32, "cpu", max_positions=256, seed=5)


@pytest.mark.parametrize("decode_kernel", ["torch", "cpu_kernel"])
def test_a_mixed_step_computes_what_its_parts_compute(tiny, decode_kernel):
    """1. prefill three sequences to contexts 30, 9 and 50 and a fourth to 40;
    2. one mixed step: the three decode, a new prompt prefills whole, the fourth continues
       with a 12-token chunk at 40;
    3. the same four rows, each in a step of its own, on a copy of the step-1 cache.
    Logits agree to rounding (the matmuls' row counts differ)."""
    spec, model = tiny
    if decode_kernel == "cpu_kernel":
        if load_cpu_decode_kernel() is None:
            pytest.skip("the C++ decode kernel did not build")
        model.set_decode_kernel(paged_decode_cpu)
    try:
        kv = KVCache.allocate(spec.num_layers, 64, BLOCK, spec.num_kv_heads, spec.head_dim,
                              torch.float32, "cpu")
        gen = torch.Generator().manual_seed(1)
        tok = lambda n: torch.randint(3, spec.vocab_size, (n,), generator=gen).tolist()  # noqa
        tables = {"a": [5, 9, 2, 30], "b": [11, 12], "c": [40, 1, 3, 7, 8, 20, 21],
                  "d": [50, 51, 52, 53, 54, 55, 56], "e": [60, 61, 62]}
        lens = {"a": 30, "b": 9, "c": 50, "d": 40}
        for rid, n in lens.items():
            _step(model, kv, [Seq(rid, tok(n), 0, tables[rid])], 0)
        decodes = [Seq(rid, tok(1), lens[rid], tables[rid]) for rid in "abc"]
        prefills = [Seq("e", tok(20), 0, tables["e"]), Seq("d", tok(12), 40, tables["d"])]
        cache = kv.pool.clone()
        mixed = _step(model, kv, decodes + prefills, len(decodes))
        kv.pool.copy_(cache)
        parts = torch.cat([_step(model, kv, decodes, len(decodes))]
                          + [_step(model, kv, [p], 0) for p in prefills])
        assert mixed.shape == parts.shape == (5, spec.vocab_size)
        assert (mixed - parts).abs().max().item() < 1e-5
    finally:
        model.set_decode_kernel(None)


def _step(model, kv, seqs, num_decodes):
    inputs = build_batch_inputs(Batch(seqs, num_decodes), BLOCK, torch.device("cpu"),
                                with_decode_mask=model.layers[0].self_attn.decode_fn is None)
    return model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.logits_indices)
