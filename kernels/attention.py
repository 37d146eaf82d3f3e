"""Attention over the paged KV cache: the torch reference implementation.

`paged_attention` is correct for any mix of single-token decodes and prefill chunks (a
chunk may start mid-prompt, after earlier chunks or cached prefix blocks). It reads keys
and values only through block tables, never from the current step's tensors, so a Triton
kernel can replace either half behind the same signature.

Grouped-query attention without copying K/V per query head: the G = heads / kv_heads query
heads that share one KV head are laid out as G query rows against that KV head.
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
                    prefill_fn=None) -> torch.Tensor:
    """q: [T, H, D]; caches: [num_blocks, block_size, KVH, D] -> out [T, H, D].

    `key`/`value` ([T, KVH, D], already stored in the cache) are an optional shortcut: a
    chunk that starts at position 0 attends to them directly instead of re-reading them
    through its block table. Results are identical either way.
    """
    decode = decode_fn or decode_attention  # a kernel with decode_attention's contract
    if not meta.prefills:
        return decode(q, key_cache, value_cache, meta.decode_block_tables,
                      meta.decode_context_lens, meta.decode_max_context, scale, meta.decode_mask)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_decodes:
        out[: meta.num_decodes] = decode(
            q[: meta.num_decodes], key_cache, value_cache, meta.decode_block_tables,
            meta.decode_context_lens, meta.decode_max_context, scale, meta.decode_mask)
    for seg in meta.prefills:
        rows = slice(seg.query_start, seg.query_start + seg.query_len)
        local = None
        # A quantized or narrower cache is read back even by a fresh prefill: attending to
        # the chunk's own full-precision K/V instead would make a prompt's result depend on
        # how it was chunked (later chunks can only read the stored prefix).
        if seg.start_pos == 0 and key is not None and exact_cache(key_cache, q.dtype):
            local = (key[rows], value[rows])
        out[rows] = prefill_attention(q[rows], key_cache, value_cache, seg.block_table,
                                      seg.start_pos, scale, local, seg.mask, prefill_fn)
    return out


def exact_cache(cache, dtype: torch.dtype) -> bool:
    """Whether `cache` holds K/V exactly as computed in `dtype`: not a 1-byte format and not
    a bf16 / fp16 pool under fp32 activations (cache.kv_dtype)."""
    return not isinstance(cache, QuantizedCache) and cache.dtype == dtype


def with_chunk_masks(meta: AttentionMetadata, dtype: torch.dtype) -> AttentionMetadata:
    """`meta` with the attention mask of every continuation chunk (start_pos > 0) built,
    once per step: every layer reuses it instead of rebuilding [n, context] per layer."""
    if not any(seg.start_pos and seg.mask is None for seg in meta.prefills):
        return meta
    segments = [dataclasses.replace(seg, mask=chunk_mask(seg.start_pos, seg.query_len, dtype,
                                                          seg.block_table.device))
                if seg.start_pos and seg.mask is None else seg for seg in meta.prefills]
    return dataclasses.replace(meta, prefills=segments)


def chunk_mask(start_pos: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, start_pos + n] additive mask: query i sits at position start_pos + i and sees
    keys 0..start_pos + i (0), not the later keys of its own chunk (-inf). Additive in the
    query dtype, so SDPA need not convert a bool mask in every layer."""
    return torch.full((n, start_pos + n), float("-inf"), dtype=dtype,
                      device=device).triu_(start_pos + 1)


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
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence. q: [B, H, D] -> [B, H, D].

    `mask` [B, 1, 1, nb * block_size] (key visible) may be precomputed once per step."""
    b, h, d = q.shape
    kvh = key_cache.shape[2]
    bs = key_cache.shape[1]
    nb = cdiv(max_context, bs)
    tables = block_tables[:, :nb]
    k = gather_context(key_cache, tables, q.dtype).transpose(1, 2)    # [B, KVH, L, D]
    v = gather_context(value_cache, tables, q.dtype).transpose(1, 2)
    qg = q.reshape(b, kvh, h // kvh, d)                       # [B, KVH, G, D]
    if mask is None:
        mask = decode_mask(context_lens, nb * bs)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, h, d)


def decode_mask(context_lens: torch.Tensor, length: int) -> torch.Tensor:
    """[B] context lengths -> [B, 1, 1, length] bool, True where the key is visible."""
    visible = torch.arange(length, device=context_lens.device)[None, :] < context_lens[:, None]
    return visible[:, None, None, :]


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, start_pos: int, scale: float,
                      local: tuple[torch.Tensor, torch.Tensor] | None = None,
                      mask: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """A chunk of n query tokens at positions [start_pos, start_pos + n). q: [n, H, D].

    `local`: the chunk's own (key, value) [n, KVH, D], usable when start_pos == 0.
    `mask`: chunk_mask(start_pos, n, ...) when start_pos > 0, if already built.
    `kernel`: a causal attention kernel over the gathered context (the CPU's C++ one)
    instead of SDPA; it needs no mask. If it has a `paged` form, that one reads the context
    through the block table itself (no gathered copy)."""
    n, h, d = q.shape
    kvh = key_cache.shape[2]
    ctx = start_pos + n
    bs = key_cache.shape[1]
    nb = cdiv(ctx, bs)
    paged = getattr(kernel, "paged", None)
    if paged is not None and local is None and not isinstance(key_cache, QuantizedCache):
        # (a bf16 / fp16 pool under fp32 activations too: the kernel widens its rows)
        return paged(q, key_cache, value_cache, block_table[:nb], start_pos, scale)
    if local is not None and start_pos == 0:
        k, v = local[0].transpose(0, 1), local[1].transpose(0, 1)              # [KVH, n, D]
    else:
        k = gather_context(key_cache, block_table[:nb], q.dtype)[:ctx].transpose(0, 1)
        v = gather_context(value_cache, block_table[:nb], q.dtype)[:ctx].transpose(0, 1)
    if kernel is not None:
        return kernel(q, k, v, scale)
    qh = q.transpose(0, 1).unsqueeze(0)                        # [1, H, n, D]
    if start_pos == 0:
        # Plain causal prefill: the fused kernel's top-left causal mask is exactly right.
        o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                           scale=scale, enable_gqa=h != kvh)
    else:
        if mask is None:
            mask = chunk_mask(start_pos, n, q.dtype, q.device)                   # [n, ctx]
        o = F.scaled_dot_product_attention(qh, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           scale=scale, enable_gqa=h != kvh)
    return o[0].transpose(0, 1)                                # [n, H, D]
