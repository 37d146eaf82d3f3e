"""Phi-3 and Phi-4: Llama's block stored fused (`qkv_proj`, `gate_up_proj`, which the
loader takes as they are), LongRoPE with short and long factors, partial rotary
(`partial_rotary_factor`), and on some checkpoints a sliding window in every layer."""

from tokenloom.kernels.models.model_spec import SLIDING, sliding_layers
from tokenloom.kernels.models.registry import Family


def options(cfg) -> dict:
    types, window = sliding_layers(cfg, [SLIDING] * cfg.num_hidden_layers,
                                   getattr(cfg, "sliding_window", None))
    return {"layer_types": types, "sliding_window": window}


FAMILY = Family("phi3", ("Phi3ForCausalLM",), options,
                lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                summary="Phi-3, Phi-3.5, Phi-4, Phi-4-mini (fused weights, LongRoPE, partial "
                        "rotary)")
