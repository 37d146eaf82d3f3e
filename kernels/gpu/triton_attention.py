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
depend only on PARTITION: at a given partition a sequence's result does not depend on what
else is in the batch. `SplitDecode` picks the partition per call from the batch and the SM
count (kernels/gpu/decode_split.py), so two steps of different shape may round a row differently.
Integer arguments that vary with the batch (table width, scratch strides) are not
specialized, so the compiled variants are exactly the constexpr ones (`precompile`).

`store_kv_triton` writes each token's K/V rows into its slot; slot < 0 is skipped in the
kernel, without a host sync, which is what padded rows of a captured graph need.

On CPU these run under the Triton interpreter (TRITON_INTERPRET=1) for tests only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.arith import cdiv
from tokenloom.kernels.gpu.decode_split import SplitRule, Variant

DEFAULT_PARTITION = 512
REDUCE_CHUNK = 16   # partitions the reduce merges per step (any count, constant registers)

# Shape-dependent integers and small pointers: one compiled variant serves every batch.
_VARYING = ["stride_tb", "stride_ob", "stride_oh", "stride_lb", "stride_lh"]


@triton.jit(do_not_specialize=_VARYING,
            do_not_specialize_on_alignment=["tables_ptr", "lens_ptr"])
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


@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_lb", "stride_lh"],
            do_not_specialize_on_alignment=["lens_ptr"])
def _decode_reduce(part_ptr, lse_ptr, lens_ptr, out_ptr,
                   stride_pb, stride_ph, stride_ps,
                   stride_lb, stride_lh,
                   stride_ob, stride_oh,
                   HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, CHUNK: tl.constexpr):
    """Online log-sum-exp merge of the row's partitions, CHUNK at a time (up to
    decode_split's max_partitions per row without a register array that grows with it)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    n_parts = (ctx + PARTITION - 1) // PARTITION
    d = tl.arange(0, HEAD_DIM)
    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    part_row = part_ptr + b * stride_pb + h * stride_ph
    m = tl.full([1], float("-inf"), tl.float32)
    total = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for p0 in range(0, n_parts, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        pmask = p < n_parts
        lse = tl.load(lse_row + p, mask=pmask, other=float("-inf"))      # [CHUNK]
        m_new = tl.maximum(m, tl.max(lse, axis=0))                       # finite: p0 < n_parts
        alpha = tl.exp(m - m_new)
        w = tl.where(pmask, tl.exp(lse - m_new), 0.0)
        parts = tl.load(part_row + p[:, None] * stride_ps + d[None, :], mask=pmask[:, None],
                        other=0.0)                                        # [CHUNK, D] fp32
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    out = acc / total
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def paged_decode_triton(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        max_context: int, scale: float, mask: torch.Tensor | None = None,
                        partition: int = DEFAULT_PARTITION, block_n: int = 64) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]; same contract as attention.decode_attention (`mask` is
    not needed: the kernel stops at each context length). Every context length must be
    >= 1 and <= max_context. The grid covers max_context in partitions of `partition`."""
    return _launch(q, key_cache, value_cache, block_tables, context_lens, scale,
                   partition, max(1, cdiv(max_context, partition)), block_n)


def _launch(q, key_cache, value_cache, block_tables, context_lens, scale: float,
            partition: int, num_parts: int, block_n: int) -> torch.Tensor:
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
            HEAD_DIM=d, PARTITION=partition, CHUNK=REDUCE_CHUNK, num_warps=4)
    return out


class SplitDecode:
    """The decode-attention callable the model uses on CUDA (decode_attention's contract):
    each call picks its partition with `rule` (kernels/gpu/decode_split.py) from the batch's
    rows and longest context; inside a CUDA graph capture, from the graph rule (fixed at
    capture, grid over the whole table width)."""

    def __init__(self, rule: SplitRule):
        self.rule = rule
        self._last = (None, None)   # every layer of a step asks the same question: ask once

    def variant(self, rows: int, max_context: int, capturing: bool) -> Variant:
        if capturing:
            return self.rule.graph(rows, max_context)
        return self.rule.eager(rows, max_context)

    def __call__(self, q, key_cache, value_cache, block_tables, context_lens, max_context: int,
                 scale: float, mask=None) -> torch.Tensor:
        key = (q.shape[0], max_context, q.is_cuda and torch.cuda.is_current_stream_capturing())
        if self._last[0] != key:
            self._last = (key, self.variant(*key))
        v = self._last[1]
        num_parts = 1 if v.direct else cdiv(max_context, v.partition)
        return _launch(q, key_cache, value_cache, block_tables, context_lens, scale,
                       v.partition, num_parts, self.rule.block_n)

    def server_variants(self, max_rows: int, width: int, graph_sizes=()) -> set[Variant]:
        """Every variant a server can meet: eager steps of 1..max_rows decode rows with
        contexts up to `width` (the block-table width in tokens), and the captured buckets."""
        return self.rule.eager_variants(max_rows, width) | self.rule.graph_variants(graph_sizes,
                                                                                   width)

    def precompile(self, variants, dtype: torch.dtype, block_size: int,
                   device: torch.device | str) -> None:
        """Launch the kernel once per variant (tiny inputs of the model's dtype and shapes,
        so each compiles now and never on live traffic)."""
        r = self.rule
        kc = torch.zeros((2, block_size, r.kv_heads, r.head_dim), dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        q = torch.zeros((1, r.heads, r.head_dim), dtype=dtype, device=device)
        tables = torch.zeros((1, 1), dtype=torch.int64, device=device)
        lens = torch.ones(1, dtype=torch.int64, device=device)
        for v in sorted(variants, key=lambda v: (v.partition, v.direct)):
            _launch(q, kc, vc, tables, lens, 1.0, v.partition, 1 if v.direct else 2, r.block_n)

    def prepare_capture(self, rows: int, width: int, kv) -> None:
        """Compile the variant a graph of `rows` captured at `width` tokens uses (a compile
        cannot happen inside a stream capture)."""
        self.precompile({self.rule.graph(rows, width)}, kv.key[0].dtype, kv.block_size,
                        kv.key[0].device)


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device (model.device cuda:N sets it)."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def make_decode_kernel(spec, sms: int | None = None, block_n: int = 64) -> SplitDecode:
    """The decode kernel for this model's heads on the current GPU (or `sms` SMs)."""
    return SplitDecode(SplitRule(heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                                 head_dim=spec.head_dim, sm_count=sms or sm_count(),
                                 block_n=block_n))


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
