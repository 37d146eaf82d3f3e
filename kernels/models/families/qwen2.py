"""Qwen2 / Qwen2.5: Llama's block with biases on q, k and v; with `use_sliding_window`,
the layers from `max_window_layers` on attend over a sliding window (transformers puts the
result in `layer_types`)."""

from tokenloom.kernels.models.model_spec import sliding_layers
from tokenloom.kernels.models.registry import Family


def options(cfg) -> dict:
    types, window = sliding_layers(cfg, getattr(cfg, "layer_types", None),
                                   getattr(cfg, "sliding_window", None))
    return {"attention_bias": True, "layer_types": types, "sliding_window": window}


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), options,
                summary="Qwen2, Qwen2.5 (qkv bias; sliding-window layers; yarn)")
