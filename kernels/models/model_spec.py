"""The shape of a supported decoder-only model, read from a Hugging Face config.

`ModelSpec` is the only thing the forward pass, the KV cache sizing and the loader need to
know about a model; it is built once from `config.json` (via transformers' config classes,
which normalise field names across versions) and never mutated. The fields after
`bos_token_id` are the options families differ by (kernels/models/registry.py maps each
architecture to the family file that sets them); their defaults are Llama's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


class UnsupportedModelError(ValueError):
    """The model directory exists but describes something we cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Dimensions of a head that rotate (partial rotary); 0: the whole head (set by the spec).
    rotary_dim: int = 0
    # yarn and longrope: the cos/sin scale (None: derived from `factor`, as transformers does).
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool               # q, k and v projections have biases
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # -- what families differ by ---------------------------------------------------------
    o_bias: bool = False               # the output projection has a bias
    qk_norm: bool = False              # RMSNorm over each head of q and k, before RoPE
    # The gated MLP's: "silu" (SwiGLU), "gelu_tanh" (GeGLU, tanh approximation), "gelu".
    activation: str = "silu"
    # Norm weights stored as w - 1 (Gemma's `x * (1 + w)`): 1 is added at load, and the
    # scaling is done in fp32 before the cast back (Gemma's order, not Llama's).
    norm_offset: float = 0.0
    # Norms around each sublayer's output too (Gemma 2/3: four norms a layer).
    sandwich_norms: bool = False
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size), in the model dtype
    attention_scale: float | None = None   # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None   # scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None
    # Per layer, FULL or SLIDING (the last `sliding_window` positions, the query's own
    # included); empty: every layer FULL.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope_local: RopeSpec | None = None  # the sliding layers' RoPE where it differs (Gemma 3)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, or None (full attention)."""
        return self.sliding_window if self.layer_type(layer) == SLIDING else None

    def layer_rope(self, layer: int) -> RopeSpec:
        if self.rope_local is not None and self.layer_type(layer) == SLIDING:
            return self.rope_local
        return self.rope

    @property
    def has_sliding_layers(self) -> bool:
        return self.sliding_window is not None and SLIDING in self.layer_types

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The seeds' formula: layers x 2 (K and V) x kv_heads x head_dim x bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def rope_from_config(cfg: Any, params: dict | None = None, head_dim: int | None = None
                     ) -> RopeSpec:
    """The RoPE of `params` (default: the config's own parameters). transformers >= 5
    normalises rope settings into `rope_parameters` (per layer type for Gemma 3); older
    configs use `rope_theta` + `rope_scaling`. Accept both. An unsupported scaling is
    refused naming the field."""
    if params is None:
        params = dict(getattr(cfg, "rope_parameters", None) or {})
        params = {**(getattr(cfg, "rope_scaling", None) or {}), **params}
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "su":            # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json rope_parameters.rope_type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    head_dim = head_dim or _head_dim(cfg)
    partial = float(params.get("partial_rotary_factor",
                               getattr(cfg, "partial_rotary_factor", None) or 1.0))
    rotary_dim = int(head_dim * partial)
    max_pos = int(cfg.max_position_embeddings)
    original = params.get("original_max_position_embeddings",
                          getattr(cfg, "original_max_position_embeddings", None))
    factor = params.get("factor")
    if rope_type == "longrope":
        original = int(original or max_pos)
        if factor is None:   # Phi-3: the ratio of the two windows (transformers' rule)
            factor = max_pos / original
        for name in ("short_factor", "long_factor"):
            if len(params.get(name) or ()) != rotary_dim // 2:
                raise UnsupportedModelError(
                    f"config.json rope_parameters.{name} must have {rotary_dim // 2} entries "
                    f"(rotary_dim / 2), got {len(params.get(name) or ())}")
    if rope_type == "yarn" and factor is None:
        factor = max_pos / int(original)
    return RopeSpec(
        theta=theta, rope_type=rope_type, factor=float(factor if factor is not None else 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,   # 0: the whole head
        attention_factor=_float_or_none(params.get("attention_factor")),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_float_or_none(params.get("mscale")),
        mscale_all_dim=_float_or_none(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()))



def _float_or_none(x) -> float | None:
    return None if x is None else float(x)


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def base_spec(cfg: Any, family: str, **options) -> ModelSpec:
    """The fields every family reads the same way, plus the family's `options`."""
    archs = list(getattr(cfg, "architectures", None) or [])
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    head_dim = _head_dim(cfg)
    fields = dict(
        architecture=archs[0], family=family, vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size), intermediate_size=int(cfg.intermediate_size),
        num_layers=int(cfg.num_hidden_layers), num_heads=int(cfg.num_attention_heads),
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        head_dim=head_dim, rms_norm_eps=float(cfg.rms_norm_eps),
        rope=options.pop("rope", None) or rope_from_config(cfg, head_dim=head_dim),
        max_position_embeddings=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        eos_token_ids=eos_ids, bos_token_id=getattr(cfg, "bos_token_id", None))
    fields.update(options)
    spec = ModelSpec(**fields)
    if spec.layer_types and len(spec.layer_types) != spec.num_layers:
        raise UnsupportedModelError(
            f"config.json layer_types has {len(spec.layer_types)} entries for "
            f"{spec.num_layers} layers")
    if spec.activation not in ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported activation {spec.activation!r} "
                                    f"(supported: {', '.join(ACTIVATIONS)})")
    return spec


def sliding_layers(cfg: Any, types: list[str] | None, window: int | None,
                   ) -> tuple[tuple[str, ...], int | None]:
    """(layer_types, sliding_window) from a config's `layer_types` and window: a window as
    long as the context changes nothing (every layer then counts as full attention)."""
    n = int(cfg.num_hidden_layers)
    types = list(types or [FULL] * n)
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise UnsupportedModelError(f"config.json layer_types: unsupported {unknown} "
                                    f"(supported: {FULL}, {SLIDING})")
    if not window or int(window) >= int(cfg.max_position_embeddings) or SLIDING not in types:
        return (), None
    return tuple(types), int(window)


def spec_from_hf_config(cfg: Any) -> ModelSpec:
    """Build a ModelSpec from a transformers `PretrainedConfig` (or raise a clear error)."""
    from tokenloom.kernels.models.registry import family_for

    archs = list(getattr(cfg, "architectures", None) or [])
    if not archs:
        raise UnsupportedModelError("config.json has no `architectures` entry")
    return family_for(archs[0]).spec(cfg)
