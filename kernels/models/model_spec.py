"""The shape of a supported decoder-only model, read from a Hugging Face config.

`ModelSpec` is the only thing the forward pass, the KV cache sizing and the loader need to
know about a model; it is built once from `config.json` (via transformers' config classes,
which normalise field names across versions) and never mutated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Hugging Face architecture name -> our family. Qwen2 is the Llama block plus qkv bias.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


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
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The seeds' formula: layers x 2 (K and V) x kv_heads x head_dim x bytes."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes


def _rope_from_config(cfg: Any) -> RopeSpec:
    # transformers >= 5 normalises rope settings into `rope_parameters`; older configs use
    # `rope_theta` + `rope_scaling`. Accept both.
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    scaling = getattr(cfg, "rope_scaling", None) or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def spec_from_hf_config(cfg: Any) -> ModelSpec:
    """Build a ModelSpec from a transformers `PretrainedConfig` (or raise a clear error)."""
    archs = list(getattr(cfg, "architectures", None) or [])
    if not archs:
        raise UnsupportedModelError("config.json has no `architectures` entry")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    if family == "qwen2":
        attention_bias = True
    else:
        attention_bias = bool(getattr(cfg, "attention_bias", False))
    # Qwen2 applies its window only with `use_sliding_window`; Mistral has no such switch and
    # always applies a configured window. A window covering the whole context changes nothing.
    window = getattr(cfg, "sliding_window", None)
    if (window and getattr(cfg, "use_sliding_window", True)
            and window < int(cfg.max_position_embeddings)):
        raise UnsupportedModelError(
            f"sliding-window attention is not supported (sliding_window={window} is shorter "
            f"than max_position_embeddings={cfg.max_position_embeddings})")
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=int(cfg.vocab_size),
        hidden_size=int(cfg.hidden_size),
        intermediate_size=int(cfg.intermediate_size),
        num_layers=int(cfg.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.rms_norm_eps),
        rope=_rope_from_config(cfg),
        max_position_embeddings=int(cfg.max_position_embeddings),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        attention_bias=attention_bias,
        eos_token_ids=eos_ids,
        bos_token_id=getattr(cfg, "bos_token_id", None),
    )
