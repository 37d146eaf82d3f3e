"""Fused Triton kernels for the decoder layer's small ops: one launch each instead of many.

Each kernel has a torch reference in kernels/models/layers.py with the same contract and the same
rounding (sums in fp32, every intermediate the torch reference rounds to the model dtype is
rounded here too), so a fused model stays on the reference's tokens:

- `rms_norm_triton(x, weight, eps, residual=None)`: RMSNorm, optionally after adding the
  residual stream (`residual + x` is rounded to the dtype, written back as the new residual,
  then normalised). The bf16 reference is 8 kernels (add, float, pow, mean, add, rsqrt, mul,
  to, mul); this is one.
- `silu_mul_triton(gate_up)`: SiLU(gate) * up over [T, 2I] -> [T, I].
- `rope_store_triton(qkv, cos, sin, ...)`: rotates the q and k heads of the fused qkv
  projection and writes k and v into their KV-cache slots (slot < 0 skipped without a host
  sync, as padded rows of a captured graph need), returning q and k.

On CPU they run under the Triton interpreter (TRITON_INTERPRET=1) for tests only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.arith import cdiv


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 -> dtype rounded to nearest even, as torch rounds. For bf16 the rounding is
    done on the bits: the Triton interpreter's own fp32 -> bf16 cast truncates."""
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + (((u >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        y = u.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def _rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
              HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = _round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype)   # the add rounds, as in torch
        tl.store(res_ptr + row * stride_r + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = _round_to(xf * rstd, x.dtype)                                   # normalised in fp32, rounded
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    out = _round_to(w.to(tl.float32) * y.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [T, N] (rows contiguous). With `residual` [T, N]: residual += x in
    place (rounded to the dtype), and the result is RMSNorm(residual)."""
    t, n = x.shape
    assert x.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    _rms_norm[(t,)](x, residual if residual is not None else x, weight, out,
                    x.stride(0), residual.stride(0) if residual is not None else 0,
                    out.stride(0), n, eps, HAS_RESIDUAL=residual is not None,
                    BLOCK=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return out


@triton.jit
def _silu_mul(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=m, other=0.0)
    g = gate.to(tl.float32)
    silu = _round_to(g / (1.0 + tl.exp(-g)), gate.dtype)               # F.silu rounds here
    out = _round_to(silu.to(tl.float32) * up.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=m)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> SiLU(gate) * up, [T, I]."""
    t, two_i = gate_up.shape
    assert gate_up.stride(1) == 1 and two_i % 2 == 0
    n = two_i // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                          BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rope_store(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_ptr, kc_ptr, vc_ptr,
                stride_qkv, stride_cos, stride_q, stride_k, Q_HEADS: tl.constexpr,
                KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, STORE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HALF)
    src = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    cos1 = tl.load(cos_ptr + tok * stride_cos + d).to(tl.float32)
    cos2 = tl.load(cos_ptr + tok * stride_cos + HALF + d).to(tl.float32)
    sin1 = tl.load(sin_ptr + tok * stride_cos + d).to(tl.float32)
    sin2 = tl.load(sin_ptr + tok * stride_cos + HALF + d).to(tl.float32)
    dt = x1.dtype
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded like the reference.
    o1 = _round_to(_round_to(f1 * cos1, dt).to(tl.float32)
                   + _round_to(-f2 * sin1, dt).to(tl.float32), dt)
    o2 = _round_to(_round_to(f2 * cos2, dt).to(tl.float32)
                   + _round_to(f1 * sin2, dt).to(tl.float32), dt)
    if head < Q_HEADS:
        dst = q_ptr + tok * stride_q + head * HEAD_DIM
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
    else:
        kh = head - Q_HEADS
        dst = k_ptr + tok * stride_k + kh * HEAD_DIM
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
        if STORE:
            slot = tl.load(slots_ptr + tok)
            if slot >= 0:
                row = slot * (KV_HEADS * HEAD_DIM) + kh * HEAD_DIM
                tl.store(kc_ptr + row + d, o1)
                tl.store(kc_ptr + row + HALF + d, o2)
                v = src + KV_HEADS * HEAD_DIM      # this k head's v head, KV_HEADS heads on
                tl.store(vc_ptr + row + d, tl.load(v + d))
                tl.store(vc_ptr + row + HALF + d, tl.load(v + HALF + d))


def rope_store_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      key_cache: torch.Tensor | None = None,
                      value_cache: torch.Tensor | None = None,
                      slot_mapping: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 KVH) D] -> q [T, H, D] and k [T, KVH, D] rotated (cos, sin: [T, 1, D]
    or [T, D] at each token's position), v [T, KVH, D] (a view of qkv). With caches, k and v
    are also written to each token's slot (slot < 0: skipped)."""
    t = qkv.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, \
        f"head dim {head_dim} must be twice a power of two"
    cos2 = cos.reshape(t, head_dim)
    sin2 = sin.reshape(t, head_dim)
    assert cos2.stride(1) == 1 and cos2.stride() == sin2.stride()
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    if t == 0:
        return q, k, v
    store = key_cache is not None
    if store:
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        assert key_cache.dtype == qkv.dtype
    _rope_store[(t, num_heads + num_kv_heads)](
        qkv, cos2, sin2, slot_mapping if store else qkv, q, k,
        key_cache if store else q, value_cache if store else q,
        qkv.stride(0), cos2.stride(0), q.stride(0), k.stride(0),
        Q_HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, STORE=store,
        num_warps=1)
    return q, k, v


def smoke_test(device: str | torch.device, dtype: torch.dtype, *, num_heads: int,
               num_kv_heads: int, head_dim: int, hidden_size: int, intermediate_size: int,
               block_size: int, partition: int) -> str | None:
    """Run every Triton kernel the model will use once, in the model's dtype and shapes,
    against its torch reference: None when all agree, else why not. Run before the first
    request so that a kernel that fails to compile (e.g. the bf16 tensor-core branch of the
    decode kernel) drops the Triton backend for graphs and eager alike, instead of failing
    every request while /ready says 200."""
    from tokenloom.kernels.attention import decode_attention
    from tokenloom.kernels.kv_store import store_kv
    from tokenloom.kernels.models.layers import RMSNorm, add_rms_norm, rope_and_store
    from tokenloom.kernels.gpu.triton_attention import paged_decode_triton, store_kv_triton

    tol = 2e-3 if dtype == torch.float32 else 6e-2   # relative to the values' scale
    what = "?"
    try:
        g = torch.Generator(device=device).manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, device=device, generator=g).to(dtype)

        def check(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
            err = (got.float() - want.float()).abs().max().item()
            scale = max(1.0, want.float().abs().max().item())
            if not err <= tol * scale:
                return f"the Triton {name} kernel disagrees with the reference ({dtype}: max error {err:.3g})"
            return None

        # Contexts: one past a partition (two partitions and the reduce), and a short one.
        lens = [partition + 3, 5]
        blocks_per_seq = cdiv(max(lens), block_size)
        num_blocks = 2 * blocks_per_seq + 1
        kc, vc = randn(num_blocks, block_size, num_kv_heads, head_dim), randn(num_blocks, block_size, num_kv_heads, head_dim)
        tables = torch.arange(1, num_blocks, device=device).view(2, blocks_per_seq)
        lens_t = torch.tensor(lens, device=device)
        what = "KV store"
        k, v = randn(2, num_kv_heads, head_dim), randn(2, num_kv_heads, head_dim)
        slots = torch.tensor([block_size + 1, -1], device=device)
        ref_kc, ref_vc = kc.clone(), vc.clone()
        store_kv(k, v, ref_kc, ref_vc, slots, has_skip=True)
        store_kv_triton(k, v, kc, vc, slots)
        if not (torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)):
            return "the Triton KV store wrote the wrong values"
        what = "decode attention"
        q = randn(2, num_heads, head_dim)
        scale = head_dim ** -0.5
        out = paged_decode_triton(q, kc, vc, tables, lens_t, max(lens), scale, partition=partition)
        ref = decode_attention(q.float(), kc.float(), vc.float(), tables, lens_t, max(lens), scale)
        if (why := check("decode attention", out, ref)) is not None:
            return why
        what = "RMSNorm"
        norm = RMSNorm(hidden_size, 1e-5).to(device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * randn(hidden_size).float())
        x, res = randn(3, hidden_size), randn(3, hidden_size)
        with torch.no_grad():
            want, want_res = add_rms_norm(x, res, norm)
        got_res = res.clone()
        got = rms_norm_triton(x, norm.weight, norm.eps, got_res)
        if (why := check("RMSNorm", got, want) or check("residual add", got_res, want_res)):
            return why
        what = "SiLU*mul"
        gate_up = randn(3, 2 * intermediate_size)
        from tokenloom.kernels.models.layers import silu_and_mul
        if (why := check("SiLU*mul", silu_mul_triton(gate_up), silu_and_mul(gate_up))):
            return why
        if head_dim & (head_dim - 1) == 0 and head_dim >= 16:
            what = "RoPE + KV store"
            qkv = randn(2, (num_heads + 2 * num_kv_heads) * head_dim)
            ang = torch.rand(2, 1, head_dim, device=device, generator=g) * 6.28
            cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
            q0, k0, _ = rope_and_store(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
            q1, k1, _ = rope_store_triton(qkv, cos, sin, num_heads, num_kv_heads, head_dim,
                                          kc, vc, slots)
            if (why := check("RoPE", q1, q0) or check("RoPE", k1, k0)):
                return why
    except Exception as e:  # a broken driver or compiler must not stop the engine
        return f"the Triton {what} kernel failed: {type(e).__name__}: {e}"
    return None
