"""Small building blocks of the Llama-family forward: RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.kernels.models.model_spec import RopeSpec


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; bit-identical to the formula below in fp32 (tested).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Same arithmetic as transformers' LlamaRMSNorm: normalise in fp32, scale in the
        # input dtype, so logits match the oracle closely in bf16 too.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, including llama3/linear scaling."""
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth
        # blend in between (same formula as transformers' _compute_llama3_parameters).
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (so chunks can start anywhere)."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]            # [max_pos, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)             # [max_pos, head_dim]
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D] for the batch's positions — once per forward, not per layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads together) rotated by position: x*cos + rot(x)*sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                   num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor]:
    """The fused projection's output [T, (H + 2 KVH) D] -> rotated q [T, H, D], rotated k and
    v [T, KVH, D]: q and k heads rotated in one go. The reference of
    triton_fused.rope_store_triton, which also writes k and v into the cache."""
    t = qkv.shape[0]
    qk_size = (num_heads + num_kv_heads) * head_dim
    qk = apply_rope(qkv[:, :qk_size].view(t, num_heads + num_kv_heads, head_dim), cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:], qkv[:, qk_size:].view(t, num_kv_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [T, 2 * intermediate] -> [T, intermediate]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x): the residual stream's update and the next
    layer's normalised input. The reference of triton_fused.rms_norm_triton with a residual
    (which updates the residual in place, in one kernel)."""
    residual = residual + x
    return norm(residual), residual
