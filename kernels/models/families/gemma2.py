"""Gemma 2: four norms a layer (each sublayer's output normed too), RMSNorm as
`x * (1 + w)`, GeGLU (tanh), the embedding scaled by sqrt(hidden), scores scaled by
`query_pre_attn_scalar`^-0.5 and soft-capped, the logits soft-capped, and sliding-window
layers alternating with full ones."""

from tokenloom.kernels.models.model_spec import sliding_layers
from tokenloom.kernels.models.registry import Family

# Ours (layer-relative) -> the checkpoint's: Gemma names the norm on the attention output
# post_attention_layernorm, which in Llama's naming (ours) is the norm before the MLP.
GEMMA_NORMS = {"attn_output_norm.weight": "post_attention_layernorm.weight",
               "post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",
               "mlp_output_norm.weight": "post_feedforward_layernorm.weight"}


def gemma_options(cfg) -> dict:
    """What Gemma 2 and Gemma 3 share."""
    types, window = sliding_layers(cfg, getattr(cfg, "layer_types", None),
                                   getattr(cfg, "sliding_window", None))
    return {"activation": _activation(cfg), "norm_offset": 1.0, "sandwich_norms": True,
            "embedding_multiplier": float(cfg.hidden_size) ** 0.5,
            "attention_scale": float(cfg.query_pre_attn_scalar) ** -0.5,
            "final_logit_softcap": getattr(cfg, "final_logit_softcapping", None),
            "o_bias": bool(getattr(cfg, "attention_bias", False)),
            "layer_types": types, "sliding_window": window}


def _activation(cfg) -> str:
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    return {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}.get(act, str(act))


def options(cfg) -> dict:
    return {**gemma_options(cfg), "attn_logit_softcap": getattr(cfg, "attn_logit_softcapping",
                                                                  None)}


FAMILY = Family("gemma2", ("Gemma2ForCausalLM",), options, renames=GEMMA_NORMS,
                summary="Gemma 2 (soft-capping, sliding/global layers, GeGLU)")
