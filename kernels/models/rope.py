"""Rotary position embeddings: the variants checkpoints use, as one table of cos/sin per
position. Pure torch, computed once at load (never per step).

A variant is a `RopeSpec` (model_spec.py) read from the checkpoint's `rope_parameters`:

- default: inv_freq_i = theta^(-2i/d);
- linear: positions divided by `factor` (inv_freq / factor);
- llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between;
- yarn: NTK-by-parts interpolation between `beta_fast` and `beta_slow` rotations, and cos/sin
  scaled by `attention_factor` (0.1 ln(factor) + 1 unless the checkpoint says);
- longrope: per-frequency `short_factor`s for sequences within
  `original_max_position_embeddings`, `long_factor`s beyond, cos/sin scaled by
  sqrt(1 + ln(factor) / ln(original_max)); the table holds both sets, short first, and a
  token's index says which (`RotaryEmbedding.lookup`);
- dynamic (NTK): transformers recomputes the base only once a sequence outgrows
  `max_position_embeddings`; within the context window it is the default rotation, and the
  engine never serves past that window.

`rotary_dim` < head_dim (partial rotary, e.g. Phi-4-mini's 0.75): only the first
`rotary_dim` dimensions of each head rotate, in pairs (i, i + rotary_dim / 2); the rest pass
through. The same formulas as transformers' `modeling_rope_utils`, in fp32 (tested against
it).
"""

from __future__ import annotations

import math

import torch

from tokenloom.kernels.models.model_spec import RopeSpec


def inv_freq(rope: RopeSpec, head_dim: int, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] in fp32, the cos/sin scale). `long`: the
    longrope set for long sequences."""
    dim = rope.rotary_dim or head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base = 1.0 / (rope.theta ** exponents)
    kind = rope.rope_type
    if kind in ("default", "dynamic"):
        return base, 1.0
    if kind == "linear":
        return base / rope.factor, 1.0
    if kind == "llama3":
        return _llama3(rope, base), 1.0
    if kind == "yarn":
        return _yarn(rope, dim)
    if kind == "longrope":
        factors = torch.tensor(rope.long_factor if long else rope.short_factor,
                               dtype=torch.float32)
        return 1.0 / (factors * rope.theta ** exponents), _longrope_scale(rope)
    raise ValueError(f"unknown rope type {kind!r}")


def _llama3(rope: RopeSpec, inv: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by `factor`, short ones kept, a smooth blend
    in between (transformers' _compute_llama3_parameters)."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' _compute_yarn_parameters)."""
    factor, base = rope.factor, rope.theta
    scale = rope.attention_factor
    if scale is None:
        if rope.mscale and rope.mscale_all_dim:
            scale = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            scale = _yarn_mscale(factor)
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # (no singularity)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp   # the share of extrapolation per frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(scale)


def _longrope_scale(rope: RopeSpec) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def cos_sin_table(rope: RopeSpec, head_dim: int, max_positions: int, long: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, rotary_dim] in fp32 (each frequency twice: halves)."""
    freqs, scale = inv_freq(rope, head_dim, long)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    angles = pos[:, None] * freqs[None, :]                 # [max_pos, rotary_dim / 2]
    emb = torch.cat((angles, angles), dim=-1)              # [max_pos, rotary_dim]
    return emb.cos() * scale, emb.sin() * scale
