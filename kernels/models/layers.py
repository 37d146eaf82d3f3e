"""The building blocks every family's decoder is made of: RMSNorm (Llama's and Gemma's
rounding), rotary embeddings (every RoPE variant, partial rotary), the gated MLP's
activations (SwiGLU, GeGLU) and soft-capping."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.kernels.models.model_spec import RopeSpec
from tokenloom.kernels.models.rope import cos_sin_table


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`. `fp32_scale`: Gemma's order under a narrower dtype (scale in
    fp32, then cast: `(x * w).to(bf16)`), not Llama's (`w * x.to(bf16)`); in fp32 the two
    are the same. Gemma's `1 + w` is folded into the weight at load (norm_offset)."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None,
                 fp32_scale: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.fp32_scale = fp32_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op; bit-identical to the formulas below in fp32 (tested).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.fp32_scale:
            return (xf * self.weight.float()).to(dtype)
        # transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype.
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (so chunks can start
    anywhere), [positions, rotary_dim] in the model dtype. A longrope table holds the short
    set at rows [0, max_positions) and the long set after them: a token's row is its
    position, plus max_positions when its sequence uses the long set (`long_offset`): the
    whole sequence does once it is longer than the original window — transformers drops
    its cache and recomputes at that point, and so does the scheduler (batch_inputs.LongRope,
    Scheduler.restart_long_rope)."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype):
        super().__init__()
        cos, sin = cos_sin_table(rope, head_dim, max_positions)
        self.long_offset = 0
        self.original_max_positions = rope.original_max_position_embeddings
        if rope.rope_type == "longrope":
            cos_l, sin_l = cos_sin_table(rope, head_dim, max_positions, long=True)
            cos, sin = torch.cat((cos, cos_l)), torch.cat((sin, sin_l))
            self.long_offset = max_positions
        self.rotary_dim = cos.shape[1]
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, rotary_dim] for the batch's table rows — once per forward, not
        per layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] (q and k heads together) rotated by position: x*cos + rot(x)*sin
    over the first rotary_dim = cos.shape[-1] dimensions, the rest passed through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        half = rd // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
    head, tail = x[..., :rd], x[..., rd:]
    half = rd // 2
    rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    return torch.cat((head * cos + rotated * sin, tail), dim=-1)


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


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation (Gemma's `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul,
                     "gelu": gelu_and_mul}


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap), in transformers' order of operations."""
    return torch.tanh(x / cap) * cap


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x): the residual stream's update and the next
    layer's normalised input. The reference of triton_fused.rms_norm_triton with a residual
    (which updates the residual in place, in one kernel)."""
    residual = residual + x
    return norm(residual), residual
