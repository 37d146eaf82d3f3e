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

A layer's options (kernels/attention.py) are runtime arguments, so one compiled variant
serves every layer: a sliding `window` starts a row's partitions at its first visible key
(ctx - window), so the keys behind it are never read, nor their block-table entries (a
hybrid KV layout points them at a reserved block of garbage), and the reduce counts the
row's partitions from there; `softcap` > 0 caps the scores, cap * tanh(score / cap),
before the softmax (a branch the whole program takes or skips). No window is passed as the
largest int32 (the first key is then 0), no cap as 0.

`store_kv_triton` writes each token's K/V rows into its slot; slot < 0 is skipped in the
kernel, without a host sync, which is what padded rows of a captured graph need.

Quantized caches (kernels/kv_quant.py: 1-byte values, an fp32 scale per token and KV head)
take the same two decode kernels through `_decode_partition_quant`, the same body with
constexpr formats QUANT_K / QUANT_V (0: plain, 1: int8, 2: fp8 e4m3, 3: fp8 e5m2), so the
plain variants compile exactly as before. The kernel decodes the bytes to fp32 (exact in
the model dtype, so the dot still runs in it), multiplies the q.k scores by each token's key
scale (one multiply per score, not per element) and the value rows by theirs before the
P.V dot (weights times a tiny scale could underflow in fp16). A promoted layer's K or V
reads its model-dtype copy as a plain cache. `store_kv_quant_triton` is QuantizedCache.store
in one launch, capture-safe like `store_kv_triton`; its encode is bit arithmetic (round to
nearest even, as torch's casts), so its bytes and scales equal QuantizedCache.store's.

On CPU these run under the Triton interpreter (TRITON_INTERPRET=1) for tests only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.arith import cdiv
from tokenloom.kernels.gpu.decode_split import SplitRule, Variant
from tokenloom.kernels.kv_quant import KVFormat, QuantizedCache

DEFAULT_PARTITION = 512
REDUCE_CHUNK = 16   # partitions the reduce merges per step (any count, constant registers)
NO_WINDOW = 2**31 - 1   # a window longer than any context: every key visible

# Shape-dependent integers and small pointers, and the layer's window: one compiled variant
# serves every batch and every layer.
_VARYING = ["stride_tb", "stride_ob", "stride_oh", "stride_lb", "stride_lh", "window"]


def _window_arg(window: int | None) -> int:
    assert window is None or 0 < window < NO_WINDOW, f"a sliding window of {window} keys"
    return NO_WINDOW if window is None else int(window)


def _softcap_arg(softcap: float | None) -> float:
    assert softcap is None or softcap > 0, f"a soft-cap of {softcap}"
    return 0.0 if softcap is None else float(softcap)


@triton.jit
def _tanh(y):
    """tanh as Cephes tanhf computes it: an odd polynomial below |y| = 0.625 (where
    1 - 2 / (exp(2|y|) + 1) would lose its low bits), else (1 - e) / (1 + e) with
    e = exp(-2|y|) <= 1, the sign put back."""
    a = tl.abs(y)
    z = y * y
    p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
         + 1.33314422036e-1) * z - 3.33332819422e-1
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.625, y + y * z * p, tl.where(y < 0, -big, big))


@triton.jit
def _dequant(raw, FMT: tl.constexpr):
    """Stored bytes (uint8) -> fp32 values before the scale; FMT as QUANT_K."""
    if FMT == 1:
        x = raw.to(tl.int8, bitcast=True).to(tl.float32)
    elif FMT == 2:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = raw.to(tl.float8e5, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale,
            window, softcap,
            stride_qb, stride_qh,
            stride_kb, stride_ks, stride_kh,
            stride_sb, stride_ss, stride_sh,
            stride_tb,
            stride_ob, stride_oh, stride_os,
            stride_lb, stride_lh,
            G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
            PARTITION: tl.constexpr, DIRECT: tl.constexpr, DOT_FP32: tl.constexpr,
            QUANT_K: tl.constexpr, QUANT_V: tl.constexpr):
    """One (row, KV head, partition) program of the decode (see the module docstring)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    start = tl.maximum(ctx - window, 0) + part * PARTITION   # from the first visible key
    if start < ctx:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, HEAD_DIM)
        gmask = g < G
        heads = kvh * G + g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None], other=0.0)                       # [BLOCK_G, D]
        q = q.to(tl.float32) * scale
        if not DOT_FP32:
            if QUANT_K == 0:
                q = q.to(k_ptr.dtype.element_ty)   # tensor-core dot in the cache dtype
            else:
                # Decoded 1-byte values are exact in the model dtype: the dot stays in it.
                q = q.to(q_ptr.dtype.element_ty)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        end = tl.minimum(start + PARTITION, ctx)
        table_row = tables_ptr + b.to(tl.int64) * stride_tb
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            tmask = t < end
            block = tl.load(table_row + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
            within = t % BLOCK_SIZE
            row = block * stride_kb + within * stride_ks + kvh * stride_kh             # [N]
            k = tl.load(k_ptr + row[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            v = tl.load(v_ptr + row[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            if QUANT_K != 0:
                k = _dequant(k, QUANT_K)
                if not DOT_FP32:
                    k = k.to(q_ptr.dtype.element_ty)
            if QUANT_V != 0:
                v_scale = tl.load(vs_ptr + block * stride_sb + within * stride_ss
                                  + kvh * stride_sh, mask=tmask, other=0.0)      # [N]
                v = _dequant(v, QUANT_V) * v_scale[:, None]
                if not DOT_FP32:
                    v = v.to(q_ptr.dtype.element_ty)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")            # [BLOCK_G, N] fp32
            if QUANT_K != 0:
                k_scale = tl.load(ks_ptr + block * stride_sb + within * stride_ss
                                  + kvh * stride_sh, mask=tmask, other=0.0)      # [N]
                s = s * k_scale[None, :]
            if softcap > 0:
                s = softcap * _tanh(s / softcap)
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


@triton.jit(do_not_specialize=_VARYING,
            do_not_specialize_on_alignment=["tables_ptr", "lens_ptr"])
def _decode_partition(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale,
                      window, softcap,
                      stride_qb, stride_qh,
                      stride_kb, stride_ks, stride_kh,
                      stride_tb,
                      stride_ob, stride_oh, stride_os,
                      stride_lb, stride_lh,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                      PARTITION: tl.constexpr, DIRECT: tl.constexpr, DOT_FP32: tl.constexpr):
    # Model-dtype caches: no scale pointers (k/v stand in, never read).
    _attend(q_ptr, k_ptr, v_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale,
            window, softcap,
            stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, 0, 0, 0, stride_tb,
            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            G, BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PARTITION, DIRECT, DOT_FP32, 0, 0)


# A layer's scales are a view into the [layers, 2, blocks, block_size, kvh] tensor, whose
# 16-byte alignment per layer depends on the pool's shape: exempt, so that no layer can
# need a variant of its own (compiled on live traffic, or failing inside a capture).
@triton.jit(do_not_specialize=_VARYING,
            do_not_specialize_on_alignment=["tables_ptr", "lens_ptr", "ks_ptr", "vs_ptr"])
def _decode_partition_quant(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, out_ptr,
                            lse_ptr, scale, window, softcap,
                            stride_qb, stride_qh,
                            stride_kb, stride_ks, stride_kh,
                            stride_sb, stride_ss, stride_sh,
                            stride_tb,
                            stride_ob, stride_oh, stride_os,
                            stride_lb, stride_lh,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                            PARTITION: tl.constexpr, DIRECT: tl.constexpr,
                            DOT_FP32: tl.constexpr, QUANT_K: tl.constexpr,
                            QUANT_V: tl.constexpr):
    _attend(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, out_ptr, lse_ptr, scale,
            window, softcap,
            stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
            stride_sh, stride_tb, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
            G, BLOCK_G, HEAD_DIM, BLOCK_SIZE, BLOCK_N, PARTITION, DIRECT, DOT_FP32,
            QUANT_K, QUANT_V)


@triton.jit(do_not_specialize=["stride_pb", "stride_ph", "stride_lb", "stride_lh", "window"],
            do_not_specialize_on_alignment=["lens_ptr"])
def _decode_reduce(part_ptr, lse_ptr, lens_ptr, out_ptr, window,
                   stride_pb, stride_ph, stride_ps,
                   stride_lb, stride_lh,
                   stride_ob, stride_oh,
                   HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, CHUNK: tl.constexpr):
    """Online log-sum-exp merge of the row's partitions, CHUNK at a time (up to
    decode_split's max_partitions per row without a register array that grows with it)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    n_parts = (ctx - tl.maximum(ctx - window, 0) + PARTITION - 1) // PARTITION
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
                        partition: int = DEFAULT_PARTITION, block_n: int = 64, *,
                        window: int | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]; same contract as attention.decode_attention (`mask` is
    not needed: the kernel stops at each context length and starts at each window's first
    key). Every context length must be >= 1 and <= max_context. The grid covers
    max_context in partitions of `partition`."""
    return _launch(q, key_cache, value_cache, block_tables, context_lens, scale,
                   partition, max(1, cdiv(max_context, partition)), block_n, window=window,
                   softcap=softcap)


paged_decode_triton.options = ("window", "softcap")   # kernel_serves (kernels/models/decoder.py)


def _side(cache):
    """A K or V cache -> (tensor the kernel reads, its scales or None, QUANT_* flag)."""
    if not isinstance(cache, QuantizedCache):
        return cache, None, 0
    if cache.full is not None:      # promoted: the model-dtype copy is the one to read
        return cache.full, None, 0
    return cache.data, cache.scale, cache.fmt.code + 1


def _launch(q, key_cache, value_cache, block_tables, context_lens, scale: float,
            partition: int, num_parts: int, block_n: int, *, window: int | None = None,
            softcap: float | None = None) -> torch.Tensor:
    key_cache, k_scale, quant_k = _side(key_cache)
    value_cache, v_scale, quant_v = _side(value_cache)
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
    window = _window_arg(window)
    common = (block_tables, context_lens, partials, lse, scale, window, _softcap_arg(softcap),
              q.stride(0), q.stride(1),
              sk[0], sk[1], sk[2])
    tail = (block_tables.stride(0),
            partials.stride(0), partials.stride(1), partials.stride(2),
            lse.stride(0) if not direct else 0, lse.stride(1) if not direct else 0)
    meta = dict(G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), HEAD_DIM=d, BLOCK_SIZE=bs,
                BLOCK_N=block_n, PARTITION=partition, DIRECT=direct,
                # The CPU interpreter's dot has no bf16 (numpy); on a GPU the dot runs in the
                # cache dtype (the model dtype for a quantized cache).
                DOT_FP32=q.device.type == "cpu", num_warps=4)
    if quant_k == 0 and quant_v == 0:
        _decode_partition[(b, kvh, num_parts)](q, key_cache, value_cache, *common, *tail,
                                               **meta)
    else:
        if k_scale is not None and v_scale is not None:
            assert k_scale.stride() == v_scale.stride()
        ss = (k_scale if k_scale is not None else v_scale).stride()
        _decode_partition_quant[(b, kvh, num_parts)](
            q, key_cache, value_cache,
            k_scale if k_scale is not None else v_scale,   # the unread side's stand-in
            v_scale if v_scale is not None else k_scale,
            *common, ss[0], ss[1], ss[2], *tail, QUANT_K=quant_k, QUANT_V=quant_v, **meta)
    if not direct:
        _decode_reduce[(b, h)](
            partials, lse, context_lens, out, window,
            partials.stride(0), partials.stride(1), partials.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, PARTITION=partition, CHUNK=REDUCE_CHUNK, num_warps=4)
    return out


class SplitDecode:
    """The decode-attention callable the model uses on CUDA (decode_attention's contract):
    each call picks its partition with `rule` (kernels/gpu/decode_split.py) from the batch's
    rows and longest context; inside a CUDA graph capture, from the graph rule (fixed at
    capture, grid over the whole table width). A layer's window and soft-cap are the
    kernel's runtime arguments: the same variants serve every layer."""

    options = ("window", "softcap")   # kernel_serves (kernels/models/decoder.py)

    def __init__(self, rule: SplitRule):
        self.rule = rule
        self._last = (None, None)   # every layer of a step asks the same question: ask once

    def variant(self, rows: int, max_context: int, capturing: bool) -> Variant:
        if capturing:
            return self.rule.graph(rows, max_context)
        return self.rule.eager(rows, max_context)

    def __call__(self, q, key_cache, value_cache, block_tables, context_lens, max_context: int,
                 scale: float, mask=None, *, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
        key = (q.shape[0], max_context, q.is_cuda and torch.cuda.is_current_stream_capturing())
        if self._last[0] != key:
            self._last = (key, self.variant(*key))
        v = self._last[1]
        num_parts = 1 if v.direct else cdiv(max_context, v.partition)
        return _launch(q, key_cache, value_cache, block_tables, context_lens, scale,
                       v.partition, num_parts, self.rule.block_n, window=window,
                       softcap=softcap)

    def server_variants(self, max_rows: int, width: int, graph_sizes=()) -> set[Variant]:
        """Every variant a server can meet: eager steps of 1..max_rows decode rows with
        contexts up to `width` (the block-table width in tokens), and the captured buckets."""
        return self.rule.eager_variants(max_rows, width) | self.rule.graph_variants(graph_sizes,
                                                                                   width)

    def precompile(self, variants, dtype: torch.dtype, block_size: int,
                   device: torch.device | str, k_format: KVFormat | None = None,
                   v_format: KVFormat | None = None) -> None:
        """Launch the kernel once per variant (tiny inputs of the model's dtype and shapes,
        so each compiles now and never on live traffic). With the formats of a quantized
        cache, its variants too; the plain ones stay, since a promoted layer reads its
        model-dtype copy through them."""
        r = self.rule
        kc = torch.zeros((2, block_size, r.kv_heads, r.head_dim), dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        q = torch.zeros((1, r.heads, r.head_dim), dtype=dtype, device=device)
        tables = torch.zeros((1, 1), dtype=torch.int64, device=device)
        lens = torch.ones(1, dtype=torch.int64, device=device)
        caches = [(kc, vc)]
        if k_format is not None or v_format is not None:
            def quantized(fmt):
                if fmt is None:
                    return kc
                return QuantizedCache(torch.zeros(kc.shape, dtype=torch.uint8, device=device),
                                      torch.ones(kc.shape[:3], device=device), fmt, dtype)
            caches.append((quantized(k_format), quantized(v_format)))
        for v in sorted(variants, key=lambda v: (v.partition, v.direct)):
            for k_cache, v_cache in caches:
                _launch(q, k_cache, v_cache, tables, lens, 1.0, v.partition,
                        1 if v.direct else 2, r.block_n)

    def precompile_for(self, variants, kv) -> None:
        """`precompile` for the caches of `kv` (a KVCache): its model dtype, block size and
        device, and its formats when quantized."""
        key, value = kv.key[0], kv.value[0]
        if isinstance(key, QuantizedCache):
            self.precompile(variants, key.out_dtype, kv.block_size, key.device, key.fmt,
                            value.fmt)
        else:
            self.precompile(variants, key.dtype, kv.block_size, key.device)

    def prepare_capture(self, rows: int, width: int, kv) -> None:
        """Compile the variant a graph of `rows` captured at `width` tokens uses (a compile
        cannot happen inside a stream capture)."""
        self.precompile_for({self.rule.graph(rows, width)}, kv)


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
    assert key.stride(2) == 1 and key.stride(1) == d
    assert value.stride(2) == 1 and value.stride(1) == d
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    row = kvh * d
    _store_kv[(t,)](key, value, key_cache, value_cache, slot_mapping, key.stride(0),
                    value.stride(0), ROW=row, BLOCK=triton.next_power_of_2(row), num_warps=4)


@triton.jit
def _quantize(x, FMT: tl.constexpr, QMAX: tl.constexpr):
    """fp32 values already divided by their scale -> stored bytes (uint8), as
    KVFormat.encode: clamp to +-QMAX, then round to nearest even. Bit arithmetic rather than
    a cast, because the interpreter's fp32 -> fp8 cast rounds wrongly, and one path is then
    what both the tests and the GPU run."""
    x = tl.minimum(tl.maximum(x, -QMAX), QMAX)
    if FMT == 1:
        # 1.5 * 2^23: adding and subtracting it rounds |x| < 2^22 to an integer, ties even.
        code = ((x + 12582912.0) - 12582912.0).to(tl.int32) & 0xFF
    else:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80      # kept for -0 too, as torch's cast keeps it
        a = tl.abs(x)
        mag = a.to(tl.int32, bitcast=True)
        if FMT == 2:
            # e4m3: below 2^-6 the codes are multiples of 2^-9 (subnormals, and 8 is the
            # smallest normal); above, drop 20 mantissa bits rounding to even and rebias
            # the exponent (127 -> 7). The minimum keeps the unused branch in int32 range.
            sub = ((tl.minimum(a, 0.015625) * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)
            norm = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
            code = tl.where(a < 0.015625, sub, norm)
        else:
            # e5m2: subnormals are multiples of 2^-16 below 2^-14; 21 bits dropped, 127 -> 15.
            sub = ((tl.minimum(a, 0.00006103515625) * 65536.0 + 12582912.0)
                   - 12582912.0).to(tl.int32)
            norm = ((mag + 0xFFFFF + ((mag >> 21) & 1)) >> 21) - (112 << 2)
            code = tl.where(a < 0.00006103515625, sub, norm)
        code = code | sign
    return code.to(tl.uint8)


@triton.jit
def _quantize_rows(x, scale_ptrs, hmask, FMT: tl.constexpr, QMAX: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] fp32 (zero-padded) -> its bytes; stores the heads' scales."""
    amax = tl.max(tl.abs(x), axis=1)
    # div_rn: the IEEE division torch does (a plain `/` may be approximate on a GPU).
    scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
    tl.store(scale_ptrs, scale, mask=hmask)
    safe = tl.where(scale > 0, scale, 1.0)
    return _quantize(tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape)), FMT, QMAX)


@triton.jit(do_not_specialize=["stride_k", "stride_v"],
            do_not_specialize_on_alignment=["ks_ptr", "vs_ptr"])
def _store_kv_quant(key_ptr, value_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slots_ptr,
                    stride_k, stride_v, stride_sb, stride_ss,
                    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    QK: tl.constexpr, QV: tl.constexpr, K_QMAX: tl.constexpr,
                    V_QMAX: tl.constexpr):
    """Program i: token i's K and V rows into slot slots[i] (slot < 0: nothing), as
    kv_quant.quantize_into: per KV head, scale = absmax / qmax and bytes = encode(x / scale)
    (an all-zero head keeps scale 0 and zero bytes)."""
    i = tl.program_id(0)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        m = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        offs = h[:, None] * HEAD_DIM + d[None, :]                         # [BLOCK_H, BLOCK_D]
        dst = slot * (KV_HEADS * HEAD_DIM) + offs
        scale_at = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_ss + h
        hm = h < KV_HEADS
        k = tl.load(key_ptr + i * stride_k + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(kc_ptr + dst, _quantize_rows(k, ks_ptr + scale_at, hm, QK, K_QMAX), mask=m)
        v = tl.load(value_ptr + i * stride_v + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(vc_ptr + dst, _quantize_rows(v, vs_ptr + scale_at, hm, QV, V_QMAX), mask=m)


def store_kv_quant_triton(key: torch.Tensor, value: torch.Tensor, key_cache: QuantizedCache,
                          value_cache: QuantizedCache, slot_mapping: torch.Tensor) -> None:
    """QuantizedCache.store for K and V in one launch and without a host sync (CUDA-graph
    safe): key/value [T, KVH, D] into their slots, slots < 0 skipped; the bytes and scales
    are those QuantizedCache.store writes. A promoted layer's model-dtype copies are
    written too."""
    t, kvh, d = key.shape
    if t == 0:
        return
    assert key.stride(2) == 1 and key.stride(1) == d
    assert value.stride(2) == 1 and value.stride(1) == d
    kc, vc = key_cache.data, value_cache.data
    assert kc.is_contiguous() and vc.is_contiguous()
    ss = key_cache.scale.stride()
    assert ss == value_cache.scale.stride() and ss[2] == 1
    kf, vf = key_cache.fmt, value_cache.fmt
    _store_kv_quant[(t,)](key, value, kc, vc, key_cache.scale, value_cache.scale, slot_mapping,
                          key.stride(0), value.stride(0), ss[0], ss[1],
                          KV_HEADS=kvh, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(kvh),
                          BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=kc.shape[1],
                          QK=kf.code + 1, QV=vf.code + 1, K_QMAX=kf.qmax, V_QMAX=vf.qmax,
                          num_warps=4)
    if key_cache.full is not None or value_cache.full is not None:
        assert key_cache.full is not None and value_cache.full is not None, \
            "K and V are promoted together (KVCache.promote_layer)"
        store_kv_triton(key, value, key_cache.full, value_cache.full, slot_mapping)
