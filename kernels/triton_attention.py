"""Triton kernels for the paged KV cache: decode attention and the KV store.

`paged_decode_triton` has the contract of attention.decode_attention (q [B, H, D], caches
[num_blocks, block_size, KVH, D], block tables, context lengths) and reads keys and values
only through the block tables. Two kernels, flash-decoding style:

1. `_decode_partition`: grid (B, KVH, num_partitions). One program takes one KV head of one
   sequence over one slice of PARTITION tokens of its context and computes, for the G query
   heads that share that KV head, a softmax-normalised partial output and its log-sum-exp.
   Every key/value row is read once for all G heads (grouped-query attention without
   copies), BLOCK_N tokens per step, gathered through the block table (so any block size
   works). Partitions past a sequence's context exit at once, so one grid shape serves every
   mix of context lengths: a graph captured at the largest context replays for any shorter.
2. `_decode_reduce`: grid (B, H). Combines a row's partials weighted by exp(lse - max).

With a single partition the first kernel writes the output directly. Partition boundaries
depend only on PARTITION, never on the batch, so a sequence's result does not depend on what
else is in the batch (graph and eager steps agree bit for bit).

`store_kv_triton` writes each token's K/V rows into its slot; slot < 0 is skipped in the
kernel, without a host sync, which is what padded rows of a captured graph need.

On CPU these run under the Triton interpreter (TRITON_INTERPRET=1) for tests only.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

DEFAULT_PARTITION = 512
MAX_PARTITIONS = 64


@triton.jit
def _decode_partition(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale,
                      stride_qb, stride_qh,
                      stride_kb, stride_ks, stride_kh,
                      stride_tb,
                      stride_ob, stride_oh, stride_os,
                      stride_lb, stride_lh,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      PARTITION: tl.constexpr, DIRECT: tl.constexpr, DOT_FP32: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    start = part * PARTITION
    if start < ctx:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        gmask = g < G
        heads = kvh * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)                       # [BLOCK_G, D]
        q = q.to(tl.float32) * scale
        if not DOT_FP32:
            q = q.to(k_ptr.dtype.element_ty)   # tensor-core dot in the cache dtype
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        end = tl.minimum(start + PARTITION, ctx)
        table_row = tables_ptr + b.to(tl.int64) * stride_tb
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            block = tl.load(table_row + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            row = block * stride_kb + (t % BLOCK_SIZE) * stride_ks + kvh * stride_kh   # [N]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")            # [BLOCK_G, N] fp32
            s = tl.where(tmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        out = acc / l_i[:, None]
        o_off = b * stride_ob + heads[:, None] * stride_oh + part * stride_os + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
        if not DIRECT:
            tl.store(lse_ptr + b * stride_lb + heads * stride_lh + part, m_i + tl.log(l_i),
                     mask=gmask)


@triton.jit
def _decode_reduce(part_ptr, lse_ptr, lens_ptr, out_ptr,
                   stride_pb, stride_ph, stride_ps,
                   stride_lb, stride_lh,
                   stride_ob, stride_oh,
                   HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    n_parts = (ctx + PARTITION - 1) // PARTITION
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, HEAD_DIM)
    pmask = p < n_parts
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + p, mask=pmask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = tl.where(pmask, w, 0.0)
    parts = tl.load(part_ptr + b * stride_pb + h * stride_ph + p[:, None] * stride_ps + d[None, :],
                    mask=pmask[:, None], other=0.0)                         # [BLOCK_P, D] fp32
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def partition_for(max_model_len: int) -> int:
    """The partition size that keeps the scratch space bounded (<= MAX_PARTITIONS per row)
    for a given context length: DEFAULT_PARTITION, doubled as needed."""
    part = DEFAULT_PARTITION
    while -(-max_model_len // part) > MAX_PARTITIONS:
        part *= 2
    return part


def paged_decode_triton(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        max_context: int, scale: float, mask: torch.Tensor | None = None,
                        partition: int = DEFAULT_PARTITION, block_n: int = 64) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]; same contract as attention.decode_attention (`mask` is
    not needed: the kernel stops at each context length). Every context length must be
    >= 1 and <= max_context."""
    b, h, d = q.shape
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    assert h % kvh == 0, f"{h} query heads do not group over {kvh} KV heads"
    assert key_cache.stride(3) == 1 and key_cache.stride() == value_cache.stride()
    assert d & (d - 1) == 0 and d >= 16, f"head dim {d} must be a power of two >= 16"
    assert partition % block_n == 0
    assert q.stride(2) == 1, "q rows must be contiguous in the head dim"
    g = h // kvh
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    num_parts = max(1, -(-max_context // partition))
    direct = num_parts == 1
    if direct:
        partials, lse = out.view(b, h, 1, d), out   # lse unused
    else:
        partials = torch.empty((b, h, num_parts, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, h, num_parts), dtype=torch.float32, device=q.device)
    sk = key_cache.stride()
    _decode_partition[(b, kvh, num_parts)](
        q, key_cache, value_cache, block_tables, context_lens, partials, lse, scale,
        q.stride(0), q.stride(1),
        sk[0], sk[1], sk[2],
        block_tables.stride(0),
        partials.stride(0), partials.stride(1), partials.stride(2),
        lse.stride(0) if not direct else 0, lse.stride(1) if not direct else 0,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), HEAD_DIM=d, BLOCK_SIZE=bs,
        BLOCK_N=block_n, PARTITION=partition, DIRECT=direct,
        # The CPU interpreter's dot has no bf16 (numpy); on a GPU the dot runs in the cache dtype.
        DOT_FP32=q.device.type == "cpu", num_warps=4)
    if not direct:
        _decode_reduce[(b, h)](
            partials, lse, context_lens, out,
            partials.stride(0), partials.stride(1), partials.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, PARTITION=partition, BLOCK_P=triton.next_power_of_2(num_parts),
            num_warps=4)
    return out


def make_decode_kernel(max_model_len: int):
    """paged_decode_triton with the partition size for this context length."""
    return functools.partial(paged_decode_triton, partition=partition_for(max_model_len))


@triton.jit
def _store_kv(key_ptr, value_ptr, kc_ptr, vc_ptr, slots_ptr, stride_k, stride_v,
              ROW: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        m = offs < ROW
        dst = slot.to(tl.int64) * ROW + offs
        tl.store(kc_ptr + dst, tl.load(key_ptr + i * stride_k + offs, mask=m), mask=m)
        tl.store(vc_ptr + dst, tl.load(value_ptr + i * stride_v + offs, mask=m), mask=m)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, KVH, D] into their slots; slots < 0 are skipped (no host sync).
    Each token's [KVH, D] rows must be contiguous; caches contiguous per layer."""
    t, kvh, d = key.shape
    if t == 0:
        return
    assert key.stride(2) == 1 and key.stride(1) == d and value.stride(2) == 1 and value.stride(1) == d
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    row = kvh * d
    _store_kv[(t,)](key, value, key_cache, value_cache, slot_mapping, key.stride(0),
                    value.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4)
