"""The quantized KV cache (kernels/kv_quant.py): error bounds per format, rows quantized
independently of how they are batched, skipped slots, copy-on-write, promotion, and the
1-byte form with its scales through swap and the KV tiers' block records."""

from __future__ import annotations

import pytest
import torch

from tokenloom.config.schema import CacheConfig, ConfigError
from tokenloom.kernels.attention import decode_attention, gather_context, prefill_attention
from tokenloom.kernels.kv_quant import FORMATS, QuantizedCache, quantized_bytes_per_block
from tokenloom.kernels.kv_store import HostKVPool, KVCache, gather_blocks, scatter_blocks, store_kv

LAYERS, BLOCKS, BS, KVH, D = 2, 12, 8, 2, 16
# Worst relative error of one value against its row's absmax (int8: half a level of 127)
# or against itself (fp8: half an ulp of a 3- or 2-bit mantissa), with float slack.
BOUNDS = {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3": 2 ** -4 + 1e-6, "fp8_e5m2": 2 ** -3 + 1e-6}


def _kv(fmt: str, dtype=torch.float32) -> KVCache:
    return KVCache.allocate(LAYERS, BLOCKS, BS, KVH, D, dtype, "cpu", FORMATS[fmt], FORMATS[fmt])


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, KVH, D, generator=g)
    x[:, :, 3] *= 20          # an outlier channel, as real keys have
    return x


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_values_read_back_within_the_formats_bound(fmt):
    kv = _kv(fmt)
    x = _rows(40)
    store_kv(x, -x, kv.key[0], kv.value[0], torch.arange(40))
    got = gather_context(kv.key[0], torch.arange(5))[:40]
    err = (got - x).abs()
    if fmt == "int8":
        assert (err <= BOUNDS[fmt] * x.abs().amax(-1, keepdim=True)).all()
    else:
        # Below the format's normal range fp8 keeps an absolute step instead.
        tiny = x.abs().amax(-1, keepdim=True) * 2 ** -9
        assert (err <= BOUNDS[fmt] * x.abs() + tiny).all()
    assert torch.equal(gather_context(kv.value[0], torch.arange(5))[:40], -got)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_rows_bytes_do_not_depend_on_how_rows_are_batched(fmt):
    """One row's quantized bytes and scale are a function of that row alone: a prompt
    stored in one chunk, in odd chunks or token by token leaves the same cache."""
    x = _rows(37, seed=1)
    caches = []
    for pieces in ([37], [5, 11, 21], [1] * 37):
        kv = _kv(fmt)
        start = 0
        for n in pieces:
            slots = torch.arange(start, start + n) + 3   # not block aligned
            store_kv(x[start:start + n], x[start:start + n], kv.key[1], kv.value[1], slots)
            start += n
        caches.append(kv)
    for kv in caches[1:]:
        assert torch.equal(kv.pool, caches[0].pool)
        assert torch.equal(kv.scales, caches[0].scales)


def test_skipped_slots_write_nothing_and_zero_rows_read_zero():
    kv = _kv("int8")
    x = _rows(4)
    x[1] = 0
    store_kv(x, x, kv.key[0], kv.value[0], torch.tensor([0, 1, -1, 2]), has_skip=True)
    got = gather_context(kv.key[0], torch.tensor([0]))
    assert torch.equal(got[1], torch.zeros(KVH, D))
    assert kv.scales[0, 0, 0, 1].eq(0).all()
    assert torch.allclose(got[2], x[3], atol=x[3].abs().max().item() / 127)
    assert kv.pool[0, 0, 0, 3:].eq(0).all()          # the skipped row went nowhere


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_decode_and_prefill_attention_read_the_dequantized_cache(fmt):
    """The torch reference reads exactly the dequantized values (what every kernel is
    compared against), for decodes and for a prefill chunk with a prefix."""
    kv, ref = _kv(fmt), KVCache.allocate(LAYERS, BLOCKS, BS, KVH, D, torch.float32, "cpu")
    x, y = _rows(30, 2), _rows(30, 3)
    store_kv(x, y, kv.key[0], kv.value[0], torch.arange(30))
    deq_k = gather_context(kv.key[0], torch.arange(4))[:30]
    deq_v = gather_context(kv.value[0], torch.arange(4))[:30]
    store_kv(deq_k, deq_v, ref.key[0], ref.value[0], torch.arange(30))
    q = torch.randn(2, 4, D)
    tables = torch.arange(4)[None].repeat(2, 1)
    lens = torch.tensor([30, 17])
    assert torch.allclose(decode_attention(q, kv.key[0], kv.value[0], tables, lens, 32, 0.25),
                          decode_attention(q, ref.key[0], ref.value[0], tables, lens, 32, 0.25),
                          atol=1e-6)
    qc = torch.randn(10, 4, D)
    assert torch.allclose(
        prefill_attention(qc, kv.key[0], kv.value[0], torch.arange(4), 20, 0.25),
        prefill_attention(qc, ref.key[0], ref.value[0], torch.arange(4), 20, 0.25), atol=1e-6)


def test_copy_on_write_copies_values_scales_and_a_promoted_copy():
    kv = _kv("int8")
    kv.promote_layer(1)
    x = _rows(8)
    for layer in range(LAYERS):
        store_kv(x, x, kv.key[layer], kv.value[layer], torch.arange(8))
    kv.copy_blocks([(0, 5)])
    for layer in range(LAYERS):
        assert torch.equal(gather_context(kv.key[layer], torch.tensor([5])),
                           gather_context(kv.key[layer], torch.tensor([0])))
    assert torch.equal(kv.key[1].full[5], x)      # the promoted copy is exact


def test_a_promoted_layer_keeps_old_blocks_as_stored_and_new_ones_exact():
    kv = _kv("fp8_e5m2")
    x = _rows(8, 4)
    store_kv(x, x, kv.key[0], kv.value[0], torch.arange(8))
    before = gather_context(kv.key[0], torch.tensor([0])).clone()
    nbytes = kv.promote_layer(0)
    assert nbytes == 2 * BLOCKS * BS * KVH * D * 4
    assert kv.promoted_layers() == [0]
    assert torch.equal(gather_context(kv.key[0], torch.tensor([0])), before)
    y = _rows(8, 5)
    store_kv(y, y, kv.key[0], kv.value[0], torch.arange(8, 16))
    assert torch.equal(gather_context(kv.key[0], torch.tensor([1])), y)
    # The 1-byte form is still written (it is what swap and the tiers move)...
    assert not torch.equal(QuantizedCache(kv.key[0].data, kv.key[0].scale, kv.key[0].fmt,
                                          torch.float32).dequantize_blocks(torch.tensor([1]))[0],
                           y)
    # ... and a block written from outside refreshes the copy from it.
    rows = gather_blocks(kv.pool, [1], kv.scales)
    scatter_blocks(kv.pool, [2], rows, kv.scales)
    kv.refresh_promoted([2])
    assert torch.equal(kv.key[0].full[2], kv.key[0].dequantize_blocks(torch.tensor([2]))[0])


def test_tier_records_carry_values_and_scales():
    kv = _kv("int8")
    x = _rows(24, 6)
    for layer in range(LAYERS):
        store_kv(x, -x, kv.key[layer], kv.value[layer], torch.arange(24))
    rows = gather_blocks(kv.pool, [0, 2], kv.scales)
    assert rows.shape == (2, quantized_bytes_per_block(LAYERS, BS, KVH, D))
    other = _kv("int8")
    scatter_blocks(other.pool, [7, 3], rows, other.scales)
    for layer in range(LAYERS):
        for src, dst in ((0, 7), (2, 3)):
            assert torch.equal(gather_context(other.key[layer], torch.tensor([dst])),
                               gather_context(kv.key[layer], torch.tensor([src])))
            assert torch.equal(gather_context(other.value[layer], torch.tensor([dst])),
                               gather_context(kv.value[layer], torch.tensor([src])))


def test_swap_round_trip_keeps_values_scales_and_refreshes_promoted_layers():
    kv = _kv("fp8_e4m3")
    kv.promote_layer(0)
    x = _rows(16, 7)
    for layer in range(LAYERS):
        store_kv(x, x, kv.key[layer], kv.value[layer], torch.arange(16))
    host = HostKVPool(kv.pool, 4, kv.scales)
    want = [gather_context(kv.key[i], torch.tensor([1])).clone() for i in range(LAYERS)]
    host.swap_out(kv, [(1, 2)])
    kv.pool[:, :, 1] = 0
    kv.scales[:, :, 1] = 0
    kv.key[0].full[1] = 0
    host.swap_in(kv, [(2, 9)])
    # Layer 0 was exact before the swap; after it, it holds what the 1-byte form kept.
    assert torch.equal(kv.key[0].full[9], kv.key[0].dequantize_blocks(torch.tensor([9]))[0])
    assert torch.allclose(kv.key[0].full[9], want[0], rtol=2 ** -4, atol=1e-3)
    assert torch.equal(gather_context(kv.key[1], torch.tensor([9])), want[1])


def test_k_and_v_must_both_be_quantized_or_neither():
    with pytest.raises(ValueError, match="both"):
        KVCache.allocate(1, 2, 8, 1, 8, torch.float32, "cpu", FORMATS["int8"], None)
    with pytest.raises(ConfigError, match=r"cache\.v_dtype") as info:
        CacheConfig(k_dtype="auto", kv_dtype="int8", v_dtype="")
    assert "cache.k_dtype" in str(info.value)
    mixed = CacheConfig(k_dtype="fp8_e4m3", v_dtype="int8")
    assert mixed.kv_quantized and mixed.side_dtype("v") == "int8"


def test_mixed_formats_read_back_each_with_its_own_scale():
    kv = KVCache.allocate(1, 4, 8, KVH, D, torch.float32, "cpu", FORMATS["fp8_e4m3"],
                          FORMATS["int8"])
    x = _rows(8, 8)
    store_kv(x, x, kv.key[0], kv.value[0], torch.arange(8))
    k = gather_context(kv.key[0], torch.tensor([0]))
    v = gather_context(kv.value[0], torch.tensor([0]))
    assert not torch.equal(k, v)
    assert (v - x).abs().max() <= BOUNDS["int8"] * x.abs().max()


def test_hadamard_rotation_is_orthonormal_and_spreads_an_outlier():
    from tokenloom.kernels.kv_quant import hadamard
    r = hadamard(D, torch.float32, "cpu")
    assert torch.allclose(r @ r.T, torch.eye(D), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(80, torch.float32, "cpu")
    x = _rows(64, 9)              # channel 3 is 20x the others
    kv_plain, kv_rot = _kv("int8"), _kv("int8")
    store_kv(x, x, kv_plain.key[0], kv_plain.value[0], torch.arange(64))
    store_kv(x @ r, x @ r, kv_rot.key[0], kv_rot.value[0], torch.arange(64))
    back = gather_context(kv_rot.key[0], torch.arange(8)) @ r.T
    plain = gather_context(kv_plain.key[0], torch.arange(8))
    err_rot, err_plain = (back - x).norm(), (plain - x).norm()
    assert err_rot < 0.5 * err_plain, (err_rot, err_plain)


def test_rotation_setting_resolves_per_model_and_mode():
    from tokenloom.kernels.kv_quant import resolve_rotation
    assert resolve_rotation(CacheConfig(kv_dtype="int8"), 64) == "hadamard"
    assert resolve_rotation(CacheConfig(kv_dtype="int8"), 80) == "none"
    assert resolve_rotation(CacheConfig(), 64) == "none"
    assert resolve_rotation(CacheConfig(kv_dtype="int8", kv_rotation="none"), 64) == "none"
    with pytest.raises(ConfigError, match="power-of-two head dim; this model's is 80"):
        resolve_rotation(CacheConfig(kv_dtype="int8", kv_rotation="hadamard"), 80)
    with pytest.raises(ConfigError, match=r"cache\.kv_rotation 'hadamard' applies to a "
                                          r"quantized cache only"):
        CacheConfig(kv_rotation="hadamard")


def test_rotation_leaves_the_model_unchanged_over_a_full_precision_cache():
    """q.k and p.v are invariant under a rotation of q, k and v (undone on the output): the
    forward with it over a model-dtype cache is the forward without it, up to rounding."""
    from tokenloom.kernels.kv_quant import hadamard
    from tokenloom.kernels.models.kv_quality_gate import chunked_logits
    from tokenloom.kernels.models.random_model import SHAPES, random_model

    spec = SHAPES["tiny"]
    model = random_model(spec, torch.float32, "cpu", max_positions=256, seed=2)
    ids = torch.randint(3, spec.vocab_size, (50,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        plain = chunked_logits(model, ids, None, None, chunk=16)
        model.set_kv_rotation(hadamard(spec.head_dim, torch.float32, "cpu"))
        rotated = chunked_logits(model, ids, None, None, chunk=16)
    assert torch.allclose(plain, rotated, atol=1e-4)
