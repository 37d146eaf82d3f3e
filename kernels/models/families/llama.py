"""Llama 2 and 3 (and SmolLM): the shared decoder with none of its options. Llama 3.1's
RoPE scaling is read by model_spec.rope_from_config like every other family's."""

from tokenloom.kernels.models.registry import Family


def options(cfg) -> dict:
    # transformers' Llama puts the same bias switch on o_proj as on q, k and v.
    return {"o_bias": bool(getattr(cfg, "attention_bias", False))}


FAMILY = Family("llama", ("LlamaForCausalLM",), options,
                summary="Llama 2/3/3.1 (RoPE default, linear, llama3, yarn, dynamic), SmolLM")
