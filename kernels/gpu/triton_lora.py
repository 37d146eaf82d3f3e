"""Triton kernel for the LoRA delta of a multi-adapter batch (BGMV style).

`lora_add_triton(out, x, a, b, token_slots, rank)` adds to each row of a projection's output
the delta of that token's adapter, `(x[t] @ A_s.T) @ B_s.T`, in place. The adapter is chosen
per token (`token_slots[t]`), so one launch serves a batch whose rows belong to different
adapters, and rows of the base model (slot -1) are left unchanged. The adapters' weights are
stacked per slot: slot s owns rows s*rank..(s+1)*rank of `a` [S*rank, K] and the same columns
of `b` [N, S*rank]; the LoRA scaling (alpha / rank) is already folded into `b`.

Grid (T, cdiv(N, BLOCK_N)). One program takes one token and BLOCK_N output columns: it
shrinks x[t] to the rank-sized vector x[t] @ A_s.T (fp32, BLOCK_K of K per step; BLOCK_R is
the next power of two >= rank, the padding masked), expands it over its columns of B_s and
adds the result to out[t]. The shrink is recomputed by each of a token's column blocks (it is
rank x K, small next to the N x rank expand once BLOCK_N is large). A slot < 0 is masked in
the kernel (its loads and its store) without a host sync, and its addresses are formed from
slot 0, never out of bounds: padded rows of a captured CUDA graph need both.

`lora_add_reference` is the same contract in torch. The sums run in fp32 in both; the kernel
rounds once (out + delta, on the store), the reference rounds the delta to the dtype before
its add, so in bf16 / fp16 the two may differ by a rounding.

On CPU the kernel runs under the Triton interpreter (TRITON_INTERPRET=1) for tests only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.arith import cdiv
from tokenloom.kernels.gpu.triton_fused import _round_to


@triton.jit
def _lora_add(out_ptr, x_ptr, a_ptr, b_ptr, slots_ptr, stride_o, stride_x, stride_a, stride_b,
              stride_br, n_cols, k_dim, rank, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_R: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    # A slot < 0 masks everything off: its bounds become 0 (bounds rather than `& valid`: the
    # interpreter's `&` of a scalar and a block mask gives integers, not a mask).
    valid = slot >= 0
    k_lim = tl.where(valid, k_dim, 0)
    r_lim = tl.where(valid, rank, 0)
    n_lim = tl.where(valid, n_cols, 0)
    first = tl.maximum(slot, 0) * rank          # this slot's first row of a / column of b
    r = tl.arange(0, BLOCK_R)
    r_mask = r < r_lim
    # Shrink: acc[r] = sum_k x[t, k] * a[first + r, k], in fp32.
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_rows = a_ptr + (first + r)[:, None] * stride_a
    for k0 in range(0, k_dim, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_lim
        xk = tl.load(x_ptr + tok * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        ak = tl.load(a_rows + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    # Expand: delta[n] = sum_r acc[r] * b[n, first + r].
    n_mask = cols < n_lim
    bn = tl.load(b_ptr + cols.to(tl.int64)[:, None] * stride_b
                 + (first + r).to(tl.int64)[None, :] * stride_br,
                 mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    delta = tl.sum(bn.to(tl.float32) * acc[None, :], axis=1)
    dst = out_ptr + tok * stride_o + cols
    o = tl.load(dst, mask=n_mask, other=0.0)
    tl.store(dst, _round_to(o.to(tl.float32) + delta, out_ptr.dtype.element_ty), mask=n_mask)


def lora_add_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    token_slots: torch.Tensor, rank: int) -> torch.Tensor:
    """out [T, N] += per token t with s = token_slots[t] >= 0:
         (x[t] @ a[s*rank:(s+1)*rank].T) @ b[:, s*rank:(s+1)*rank].T
    Rows with token_slots[t] < 0 are left unchanged. In place on `out`; no host sync
    (no .item(), no tensor-dependent Python control flow), so it can be captured in a CUDA graph.
    x: [T, K] (fp32/bf16/fp16, contiguous), a: [S*rank, K] same dtype, contiguous,
    b: [N, S*rank] same dtype (any strides: LoRAStacks passes the transpose of its [S*rank, N]
    storage), token_slots: [T] int64 or int32 (may be a view of a
    larger static buffer: use only the first T entries), out: [T, N] same dtype as x (it may be a
    column slice view, so honor its strides). rank: Python int >= 1 (any value, not necessarily
    a power of two; pad inside the kernel with masks). Accumulate in fp32, cast on store.
    Returns out."""
    t, k_dim = x.shape
    n = out.shape[1]
    assert rank >= 1 and out.shape[0] == t and a.shape[1] == k_dim and b.shape[0] == n
    assert a.shape[0] % rank == 0 and b.shape[1] == a.shape[0]
    assert x.dtype == a.dtype == b.dtype == out.dtype
    assert token_slots.dtype in (torch.int32, torch.int64) and token_slots.shape[0] >= t
    assert x.stride(1) == 1 and a.stride(1) == 1 and out.stride(1) == 1
    if t == 0 or n == 0:
        return out
    block_r = max(2, triton.next_power_of_2(rank))
    # Tiles of at most 8192 (expand, [BLOCK_N, BLOCK_R]) and 4096 (shrink, [BLOCK_R, BLOCK_K])
    # elements: wide column blocks, so that few programs per token redo the shrink.
    block_n = min(triton.next_power_of_2(n), max(16, 8192 // block_r), 256)
    block_k = min(triton.next_power_of_2(k_dim), max(16, 4096 // block_r), 128)
    _lora_add[(t, cdiv(n, block_n))](
        out, x, a, b, token_slots, out.stride(0), x.stride(0), a.stride(0), b.stride(0),
        b.stride(1), n, k_dim, rank, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, num_warps=4)
    return out


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, rank: int) -> torch.Tensor:
    """`lora_add_triton` in torch: for each token t with s = token_slots[t] >= 0,
    out[t] += ((x[t] @ a[s*rank:(s+1)*rank].T) @ b[:, s*rank:(s+1)*rank].T) in fp32, rounded
    to out's dtype before the add. The tokens of a slot go through as one matmul. In place;
    returns out. Syncs with the host (it groups rows by slot): a reference, not for graphs."""
    slots = token_slots[: x.shape[0]]
    for s in slots.unique().tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().flatten()
        lo, hi = s * rank, (s + 1) * rank
        delta = (x[rows].float() @ a[lo:hi].float().T) @ b[:, lo:hi].float().T
        out[rows] += delta.to(out.dtype)
    return out
