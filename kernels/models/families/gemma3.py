"""Gemma 3 (text): Gemma 2's block with q/k norms instead of attention soft-capping, and a
RoPE of its own (base and scaling) for the sliding-window layers."""

from tokenloom.kernels.models.families.gemma2 import GEMMA_NORMS, gemma_options
from tokenloom.kernels.models.model_spec import FULL, SLIDING, rope_from_config
from tokenloom.kernels.models.registry import Family


def options(cfg) -> dict:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    out = {**gemma_options(cfg), "qk_norm": True}
    if FULL in params:   # transformers >= 5: RoPE parameters per layer type
        out["rope"] = rope_from_config(cfg, dict(params[FULL]))
        out["rope_local"] = rope_from_config(cfg, dict(params.get(SLIDING) or params[FULL]))
    return out


FAMILY = Family("gemma3", ("Gemma3ForCausalLM",), options, renames=GEMMA_NORMS,
                summary="Gemma 3 text (q/k norm, 5 local : 1 global layers, local RoPE base)")
