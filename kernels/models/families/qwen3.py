"""Qwen3 (dense): Llama's block with an RMSNorm over each head of q and k before RoPE, an
explicit `head_dim`, and the output projection's bias switched with q, k and v's."""

from tokenloom.kernels.models.model_spec import sliding_layers
from tokenloom.kernels.models.registry import Family


def options(cfg) -> dict:
    types, window = sliding_layers(cfg, getattr(cfg, "layer_types", None),
                                   getattr(cfg, "sliding_window", None))
    return {"qk_norm": True, "o_bias": bool(getattr(cfg, "attention_bias", False)),
            "layer_types": types, "sliding_window": window}


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), options,
                summary="Qwen3 dense (q/k norm, thinking chat template)")
