"""Attention over the paged KV cache: the torch reference implementation.

`paged_attention` is correct for any mix of single-token decodes and prefill chunks (a
chunk may start mid-prompt, after earlier chunks or cached prefix blocks). It reads keys
and values only through block tables, never from the current step's tensors, so a Triton
kernel can replace either half behind the same signature.

Grouped-query attention without copying K/V per query head: the G = heads / kv_heads query
heads that share one KV head are laid out as G query rows against that KV head.

Layer options (a family's, model_spec.py): `window` — the layer attends to the last
`window` positions only, the query's own included (keys k with q - window < k <= q, as
transformers' sliding-window mask); `softcap` — scores become cap * tanh(scores / cap)
before the mask and the softmax (Gemma 2). SDPA has no soft-cap: a soft-capped layer's
attention is computed with explicit products, in the query dtype as transformers' eager
attention does.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tokenloom.arith import cdiv
from tokenloom.kernels.forward_context import AttentionMetadata
from tokenloom.kernels.kv_quant import QuantizedCache


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, key: torch.Tensor | None = None,
                    value: torch.Tensor | None = None, decode_fn=None,
                    prefill_fn=None, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, D]; caches: [num_blocks, block_size, KVH, D] -> out [T, H, D].

    `key`/`value` ([T, KVH, D], already stored in the cache) are an optional shortcut: a
    chunk that starts at position 0 attends to them directly instead of re-reading them
    through its block table. Results are identical either way. `window`, `softcap`: the
    layer's options (module docstring); kernels given as `decode_fn` / `prefill_fn` must
    take them (the model hands such a layer only kernels that do).
    """
    if not meta.prefills:
        return _decode(q, key_cache, value_cache, meta, scale, decode_fn, window, softcap)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], key_cache, value_cache, meta,
                                          scale, decode_fn, window, softcap)
    for seg in meta.prefills:
        rows = slice(seg.query_start, seg.query_start + seg.query_len)
        local = None
        # A quantized or narrower cache is read back even by a fresh prefill: attending to
        # the chunk's own full-precision K/V instead would make a prompt's result depend on
        # how it was chunked (later chunks can only read the stored prefix).
        if seg.start_pos == 0 and key is not None and exact_cache(key_cache, q.dtype):
            local = (key[rows], value[rows])
        mask = seg.window_mask if window is not None else seg.mask
        out[rows] = prefill_attention(q[rows], key_cache, value_cache, seg.block_table,
                                      seg.start_pos, scale, local, mask, prefill_fn, window,
                                      softcap)
    return out


def _decode(q, key_cache, value_cache, meta: AttentionMetadata, scale: float, decode_fn,
            window: int | None, softcap: float | None) -> torch.Tensor:
    args = (q, key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
            meta.decode_max_context, scale)
    if decode_fn is None:
        mask = meta.decode_mask if window is None else meta.decode_window_mask
        return decode_attention(*args, mask, window=window, softcap=softcap)
    if window is None and softcap is None:
        return decode_fn(*args, meta.decode_mask)
    return decode_fn(*args, meta.decode_mask, window=window, softcap=softcap)


def exact_cache(cache, dtype: torch.dtype) -> bool:
    """Whether `cache` holds K/V exactly as computed in `dtype`: not a 1-byte format and not
    a bf16 / fp16 pool under fp32 activations (cache.kv_dtype)."""
    return not isinstance(cache, QuantizedCache) and cache.dtype == dtype


def with_chunk_masks(meta: AttentionMetadata, dtype: torch.dtype,
                     window: int | None = None) -> AttentionMetadata:
    """`meta` with the attention mask of every continuation chunk (start_pos > 0) built,
    once per step: every layer reuses it instead of rebuilding [n, context] per layer.
    `window`: the model's sliding window, whose layers get masks of their own (every chunk:
    the window cuts a fresh prompt's first keys too), and decodes one as well."""
    segments = []
    for seg in meta.prefills:
        if seg.start_pos and seg.mask is None:
            seg = dataclasses.replace(seg, mask=chunk_mask(seg.start_pos, seg.query_len, dtype,
                                                           seg.block_table.device))
        if window is not None and seg.window_mask is None:
            seg = dataclasses.replace(seg, window_mask=chunk_mask(
                seg.start_pos, seg.query_len, dtype, seg.block_table.device, window))
        segments.append(seg)
    changed = any(a is not b for a, b in zip(segments, meta.prefills))
    decode_window = None
    if window is not None and meta.num_decodes and meta.decode_window_mask is None \
            and meta.decode_mask is not None:
        length = meta.decode_mask.shape[-1]
        decode_window = decode_mask(meta.decode_context_lens, length, window)
    if not changed and decode_window is None:
        return meta
    decode_window = decode_window if decode_window is not None else meta.decode_window_mask
    groups = meta.group_metas
    if groups is not None:   # the same positions through other tables: the same masks
        groups = tuple(dataclasses.replace(
            g, decode_mask=meta.decode_mask, decode_window_mask=decode_window,
            prefills=[dataclasses.replace(s, mask=m.mask, window_mask=m.window_mask)
                      for s, m in zip(g.prefills, segments)]) for g in groups)
    return dataclasses.replace(meta, prefills=segments, decode_window_mask=decode_window,
                               group_metas=groups)


def chunk_mask(start_pos: int, n: int, dtype: torch.dtype, device: torch.device,
               window: int | None = None) -> torch.Tensor:
    """[n, start_pos + n] additive mask: query i sits at position start_pos + i and sees
    keys 0..start_pos + i (0), not the later keys of its own chunk (-inf); with a `window`,
    only keys after start_pos + i - window. Additive in the query dtype, so SDPA need not
    convert a bool mask in every layer."""
    if window is None:
        return torch.full((n, start_pos + n), float("-inf"), dtype=dtype,
                          device=device).triu_(start_pos + 1)
    q = torch.arange(start_pos, start_pos + n, device=device)[:, None]
    k = torch.arange(start_pos + n, device=device)[None, :]
    hidden = (k > q) | (k <= q - window)
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden,
                                                                             float("-inf"))


def gather_context(cache, block_table: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """[num_blocks, bs, KVH, D] + block ids [..., nb] -> [..., nb * bs, KVH, D] (one copy;
    a quantized cache is dequantized to the model dtype on the way, a bf16 / fp16 pool is
    widened to `dtype` when given)."""
    nb = block_table.shape[-1]
    bs, kvh, d = cache.shape[1:]
    if isinstance(cache, QuantizedCache):
        return cache.dequantize_blocks(block_table).view(*block_table.shape[:-1], nb * bs, kvh, d)
    flat = cache.index_select(0, block_table.reshape(-1))
    if dtype is not None and flat.dtype != dtype:
        flat = flat.to(dtype)
    return flat.view(*block_table.shape[:-1], nb * bs, kvh, d)


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context: int, scale: float,
                     mask: torch.Tensor | None = None, *, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence. q: [B, H, D] -> [B, H, D].

    `mask` [B, 1, 1, nb * block_size] (key visible) may be precomputed once per step (with
    the layer's `window` applied when it has one)."""
    b, h, d = q.shape
    kvh = key_cache.shape[2]
    bs = key_cache.shape[1]
    nb = cdiv(max_context, bs)
    tables = block_tables[:, :nb]
    k = gather_context(key_cache, tables, q.dtype).transpose(1, 2)    # [B, KVH, L, D]
    v = gather_context(value_cache, tables, q.dtype).transpose(1, 2)
    qg = q.reshape(b, kvh, h // kvh, d)                       # [B, KVH, G, D]
    if mask is None:
        mask = decode_mask(context_lens, nb * bs, window)
    if softcap is not None:
        return explicit_attention(qg, k, v, mask, scale, softcap).reshape(b, h, d)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, h, d)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor | None, scale: float,
                       softcap: float | None) -> torch.Tensor:
    """softmax(cap(q k^T * scale) + mask) v with explicit products, as transformers' eager
    attention computes it (scores in the query dtype, the softmax in fp32). q [..., G, D]
    against k, v [..., L, D] (the same leading dims); `mask` bool (True: visible) or
    additive."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def decode_mask(context_lens: torch.Tensor, length: int,
                window: int | None = None) -> torch.Tensor:
    """[B] context lengths -> [B, 1, 1, length] bool, True where the key is visible (the
    last `window` keys only, with a window)."""
    keys = torch.arange(length, device=context_lens.device)[None, :]
    visible = keys < context_lens[:, None]
    if window is not None:
        visible &= keys >= (context_lens[:, None] - window)
    return visible[:, None, None, :]


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, start_pos: int, scale: float,
                      local: tuple[torch.Tensor, torch.Tensor] | None = None,
                      mask: torch.Tensor | None = None, kernel=None,
                      window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """A chunk of n query tokens at positions [start_pos, start_pos + n). q: [n, H, D].

    `local`: the chunk's own (key, value) [n, KVH, D], usable when start_pos == 0.
    `mask`: chunk_mask(start_pos, n, ..., window) when needed, if already built.
    `kernel`: a causal attention kernel over the gathered context (the CPU's C++ one)
    instead of SDPA; it needs no mask. If it has a `paged` form, that one reads the context
    through the block table itself (no gathered copy)."""
    n, h, d = q.shape
    kvh = key_cache.shape[2]
    ctx = start_pos + n
    bs = key_cache.shape[1]
    nb = cdiv(ctx, bs)
    options = {} if window is None and softcap is None else {"window": window,
                                                             "softcap": softcap}
    paged = getattr(kernel, "paged", None)
    if paged is not None and local is None and not isinstance(key_cache, QuantizedCache):
        # (a bf16 / fp16 pool under fp32 activations too: the kernel widens its rows)
        return paged(q, key_cache, value_cache, block_table[:nb], start_pos, scale, **options)
    if local is not None and start_pos == 0:
        k, v = local[0].transpose(0, 1), local[1].transpose(0, 1)              # [KVH, n, D]
    else:
        k = gather_context(key_cache, block_table[:nb], q.dtype)[:ctx].transpose(0, 1)
        v = gather_context(value_cache, block_table[:nb], q.dtype)[:ctx].transpose(0, 1)
    if kernel is not None:
        return kernel(q, k, v, scale, **options)
    qh = q.transpose(0, 1).unsqueeze(0)                        # [1, H, n, D]
    if softcap is not None or window is not None or start_pos:
        if mask is None:
            mask = chunk_mask(start_pos, n, q.dtype, q.device, window)           # [n, ctx]
    if softcap is not None:
        g = h // kvh   # query heads of one KV head, as rows against it
        qg = q.view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d)
        o = explicit_attention(qg, k, v, mask.repeat(g, 1), scale, softcap)    # [KVH, G n, D]
        return o.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)
    if mask is None:
        # Plain causal prefill: the fused kernel's top-left causal mask is exactly right.
        o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                           scale=scale, enable_gqa=h != kvh)
    else:
        o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           scale=scale, enable_gqa=h != kvh)
    return o[0].transpose(0, 1)                                # [n, H, D]
