"""Mistral: Llama's block; v0.1-style checkpoints attend over a sliding window of
`sliding_window` positions in every layer (no switch: a window set is a window used)."""

from tokenloom.kernels.models.model_spec import SLIDING, sliding_layers
from tokenloom.kernels.models.registry import Family


def options(cfg) -> dict:
    types, window = sliding_layers(cfg, [SLIDING] * cfg.num_hidden_layers,
                                   getattr(cfg, "sliding_window", None))
    return {"layer_types": types, "sliding_window": window}


FAMILY = Family("mistral", ("MistralForCausalLM",), options,
                summary="Mistral 7B (v0.1's 4,096-token sliding window in every layer)")
