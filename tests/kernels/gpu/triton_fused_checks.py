"""Checks of the fused Triton kernels (kernels/gpu/triton_fused.py) against their torch
references (kernels/models/layers.py), on CPU under the Triton interpreter.

Not collected on its own: test_triton_attention.py runs this file in a subprocess with
TRITON_INTERPRET=1 (see test_triton_attention.py for why).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_triton_attention.py"

from tokenloom.kernels.gpu import triton_fused as tf  # noqa: E402
from tokenloom.kernels.kv_store import store_kv  # noqa: E402
from tokenloom.kernels.models.layers import (  # noqa: E402
    RMSNorm,
    RotaryEmbedding,
    add_rms_norm,
    rope_and_store,
    silu_and_mul,
)
from tokenloom.kernels.models.model_spec import RopeSpec  # noqa: E402


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 units in the last place between two bf16 tensors."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    # Map the sign-magnitude encoding to a monotonic integer line.
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return int((ia - ib).abs().max())


def _norm(n, dtype, seed=0):
    norm = RMSNorm(n, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [576, 100])   # SmolLM2's width; a width that is no power of two
def test_rms_norm_matches_reference(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (3 * torch.randn(5, n, generator=g)).to(dtype)
    norm = _norm(n, dtype)
    with torch.no_grad():
        want = norm(x)
    got = tf.rms_norm_triton(x, norm.weight, norm.eps)
    if dtype == torch.float32:
        assert (got - want).abs().max().item() < 1e-5
    else:
        assert _ulps_bf16(got, want) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_updates_it_in_place(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g).to(dtype)
    residual = torch.randn(4, 64, generator=g).to(dtype)
    norm = _norm(64, dtype, seed=2)
    with torch.no_grad():
        want, want_res = add_rms_norm(x, residual, norm)
    res = residual.clone()
    got = tf.rms_norm_triton(x, norm.weight, norm.eps, res)
    assert torch.equal(res, want_res), "the residual add must round exactly like torch's"
    tol = 1e-5 if dtype == torch.float32 else 0.02
    assert (got.float() - want.float()).abs().max().item() < tol
    if dtype == torch.bfloat16:
        assert _ulps_bf16(got, want) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    gate_up = (2 * torch.randn(3, 2 * 1536, generator=g)).to(dtype)   # two column blocks
    want = silu_and_mul(gate_up)
    got = tf.silu_mul_triton(gate_up)
    if dtype == torch.float32:
        assert (got - want).abs().max().item() < 1e-5
    else:
        assert _ulps_bf16(got, want) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_reference_and_skips_padded_slots(dtype):
    heads, kv_heads, d, bs, blocks = 6, 2, 64, 16, 4
    g = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(RopeSpec(theta=10000.0), d, 512, dtype)
    positions = torch.tensor([0, 5, 300, 17, 2])
    cos, sin = rope.lookup(positions)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    slots = torch.tensor([3, -1, 40, 63, -1])
    kc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    q0, k0, v0 = rope_and_store(qkv, cos, sin, heads, kv_heads, d)
    store_kv(k0, v0, ref_kc, ref_vc, slots, has_skip=True)
    q, k, v = tf.rope_store_triton(qkv, cos, sin, heads, kv_heads, d, kc, vc, slots)
    if dtype == torch.float32:
        assert (q - q0).abs().max().item() < 1e-5 and (k - k0).abs().max().item() < 1e-5
        assert (kc - ref_kc).abs().max().item() < 1e-5
    else:
        assert _ulps_bf16(q, q0) <= 1 and _ulps_bf16(k, k0) <= 1
        assert _ulps_bf16(kc, ref_kc) <= 1
    assert torch.equal(v, v0) and torch.equal(vc, ref_vc)
    # Slot -1 wrote nothing: the untouched slots hold their old values exactly.
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(kc.view(-1, kv_heads, d)[untouched], ref_kc.view(-1, kv_heads, d)[untouched])
    # Without caches it only rotates.
    q2, k2, _ = tf.rope_store_triton(qkv, cos, sin, heads, kv_heads, d)
    assert torch.equal(q2, q) and torch.equal(k2, k)


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.wide)])
def test_model_with_every_fused_kernel_matches_the_reference(dtype):
    """A tiny model with the fused kernels (and the Triton attention and store) against the
    reference model: prefill, then a mixed batch, then a padded static-buffer decode step."""
    from tokenloom.actors.execution.batch_inputs import build_batch_inputs
    from tokenloom.graphs.buffers import DecodeBuffers
    from tokenloom.graphs.capture import DecodeGraphs
    from tokenloom.kernels.gpu.triton_attention import make_decode_kernel, store_kv_triton
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.models.random_model import SHAPES, random_model

    spec = SHAPES["tiny"]
    ref = random_model(spec, dtype, "cpu", 256, seed=1)
    fused = random_model(spec, dtype, "cpu", 256, seed=1)
    fused.set_decode_kernel(make_decode_kernel(spec, sms=132))
    fused.set_kv_store_kernel(store_kv_triton)
    fused.set_fused_kernels(tf.rms_norm_triton, tf.silu_mul_triton, tf.rope_store_triton)

    def kv():
        return KVCache.allocate(spec.num_layers, 40, 16, spec.num_kv_heads, spec.head_dim,
                                dtype, "cpu")

    kv_ref, kv_fused = kv(), kv()

    def seq(rid, ids, start, table):
        return SimpleNamespace(request_id=rid, token_ids=ids, start_pos=start,
                               block_table=table, sample=True)

    def run(model, cache, seqs, nd):
        inp = build_batch_inputs(SimpleNamespace(sequences=seqs, num_decodes=nd), 16,
                                 torch.device("cpu"))
        return model(inp.input_ids, inp.positions, cache, inp.meta, inp.logits_indices)

    tol = 1e-4 if dtype == torch.float32 else 0.1
    tables = {"a": [5, 9, 2], "b": [7, 1], "c": [11, 12]}
    first = [seq("a", list(range(3, 40)), 0, tables["a"]),
             seq("b", list(range(50, 67)), 0, tables["b"])]
    want, got = run(ref, kv_ref, first, 0), run(fused, kv_fused, first, 0)
    assert (want - got).abs().max().item() < tol
    mixed = [seq("a", [7], 37, tables["a"]), seq("b", [8], 17, tables["b"]),
             seq("c", list(range(100, 130)), 0, tables["c"])]
    want, got = run(ref, kv_ref, mixed, 2), run(fused, kv_fused, mixed, 2)
    assert (want - got).abs().max().item() < tol
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    step = [seq("a", [9], 38, tables["a"]), seq("c", [10], 30, tables["c"])]
    want = run(ref, kv_ref, step, 2)
    graphs = DecodeGraphs(fused, kv_fused, DecodeBuffers(4, 4, 16, spec.vocab_size, "cpu"))
    got = graphs.run(step, 4)[:2]
    assert (want - got).abs().max().item() < tol
    # Padded rows (slot -1) wrote nowhere.
    for a, b in zip(kv_ref.key + kv_ref.value, kv_fused.key + kv_fused.value):
        assert (a.float() - b.float()).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.wide)])
def test_piecewise_pieces_with_fused_kernels_match_the_plain_forward(dtype):
    """Piecewise graphs' pieces (graphs/piecewise.py) run with the CUDA kernels: the fused
    norm updates the static residual buffer in place, RoPE+store writes the cache from the
    padded pieces (slot -1 skipped), and the Triton decode runs between them."""
    from tokenloom.actors.execution.batch_inputs import build_batch_inputs
    from tokenloom.graphs.piecewise import PiecewiseBuffers, PiecewiseGraphs
    from tokenloom.kernels.gpu.triton_attention import make_decode_kernel, store_kv_triton
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.models.random_model import SHAPES, random_model

    spec = SHAPES["tiny"]
    model = random_model(spec, dtype, "cpu", 256, seed=2)
    model.set_decode_kernel(make_decode_kernel(spec, sms=132))
    model.set_kv_store_kernel(store_kv_triton)
    model.set_fused_kernels(tf.rms_norm_triton, tf.silu_mul_triton, tf.rope_store_triton)
    caches = [KVCache.allocate(spec.num_layers, 40, 16, spec.num_kv_heads, spec.head_dim,
                               dtype, "cpu") for _ in range(2)]
    pieces = PiecewiseGraphs(model, caches[1], PiecewiseBuffers(model, 64, "cpu"))

    def seq(rid, ids, start, table):
        return SimpleNamespace(request_id=rid, token_ids=ids, start_pos=start,
                               block_table=table, sample=True)

    def both(seqs, nd, padded):
        inp = build_batch_inputs(SimpleNamespace(sequences=seqs, num_decodes=nd), 16,
                                 torch.device("cpu"), with_decode_mask=False)
        want = model(inp.input_ids, inp.positions, caches[0], inp.meta, inp.logits_indices)
        got = pieces.run(inp.input_ids, inp.positions, inp.meta, inp.logits_indices, padded)
        return want, got

    tol = 1e-4 if dtype == torch.float32 else 0.1
    tables = {"a": [5, 9, 2], "b": [7, 1], "c": [11, 12]}
    want, got = both([seq("a", list(range(3, 40)), 0, tables["a"]),
                      seq("b", list(range(50, 61)), 0, tables["b"])], 0, 64)
    assert (want - got).abs().max().item() < tol
    mixed = [seq("a", [7], 37, tables["a"]), seq("b", list(range(61, 67)), 11, tables["b"]),
             seq("c", list(range(100, 130)), 0, tables["c"])]
    want, got = both(mixed, 1, 48)
    assert (want - got).abs().max().item() < tol
    assert torch.equal(want.argmax(-1), got.argmax(-1))
    for a, b in zip(caches[0].key + caches[0].value, caches[1].key + caches[1].value):
        assert (a.float() - b.float()).abs().max().item() < tol
    # Padded tokens wrote nowhere: block 0 (in no table) is still zero.
    assert all((k[0] == 0).all() and (v[0] == 0).all()
               for k, v in zip(caches[1].key, caches[1].value))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smoke_test_runs_every_kernel_in_the_model_dtype(dtype):
    # SmolLM2's grouping and widths, scaled down; a partition of 64 so two are used.
    shapes = dict(num_heads=6, num_kv_heads=2, head_dim=64, hidden_size=96,
                  intermediate_size=160, block_size=16, partition=64)
    assert tf.smoke_test("cpu", dtype, **shapes) is None


def test_smoke_test_names_the_kernel_that_fails(monkeypatch):
    shapes = dict(num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=64,
                  intermediate_size=64, block_size=16, partition=64)
    monkeypatch.setattr(tf, "silu_mul_triton",
                        lambda gu: torch.zeros_like(gu[:, : gu.shape[1] // 2]))
    why = tf.smoke_test("cpu", torch.float32, **shapes)
    assert why is not None and "SiLU*mul" in why and "disagrees" in why

    def broken(*a, **k):
        raise RuntimeError("PTX compile failed")
    monkeypatch.setattr(tf, "rms_norm_triton", broken)
    why = tf.smoke_test("cpu", torch.bfloat16, **shapes)
    assert "RMSNorm" in why and "PTX compile failed" in why
