"""Random-weight models of named shapes, for benchmarks and GPU checks (torch only).

The GPU machine has no network and no checkpoints, so the GPU check builds models of real
shapes (SmolLM2-135M, Llama-3-8B) with random weights on the device. Timing does not depend
on the values; a std of 0.02 keeps activations finite through every layer in bf16.
"""

from __future__ import annotations

import torch

from tokenloom.kernels.llama import LlamaForCausalLM
from tokenloom.kernels.model_spec import ModelSpec, RopeSpec

SHAPES: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        architecture="LlamaForCausalLM", family="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        rms_norm_eps=1e-5, rope=RopeSpec(theta=100000.0), max_position_embeddings=8192,
        tie_word_embeddings=True, attention_bias=False, eos_token_ids=(2,), bos_token_id=1),
    "llama3-8b": ModelSpec(
        architecture="LlamaForCausalLM", family="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope=RopeSpec(theta=500000.0, rope_type="llama3", factor=8.0,
                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192),
        max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False,
        eos_token_ids=(128001,), bos_token_id=128000),
    # Small enough for CPU smoke runs; head dim 16 is the smallest the Triton kernel takes.
    "tiny": ModelSpec(
        architecture="LlamaForCausalLM", family="llama", vocab_size=256, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope=RopeSpec(theta=10000.0), max_position_embeddings=512,
        tie_word_embeddings=True, attention_bias=False, eos_token_ids=(2,), bos_token_id=1),
}


def num_parameters(spec: ModelSpec) -> int:
    """Parameters as our fused model holds them (tied LM head counted once)."""
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    attn = h * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h
    if spec.attention_bias:
        attn += spec.q_size + 2 * spec.kv_size
    layer = attn + 3 * h * i + 2 * h
    head = 0 if spec.tie_word_embeddings else v * h
    return v * h + spec.num_layers * layer + h + head


def random_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int, seed: int = 0) -> LlamaForCausalLM:
    """Built on the meta device, materialised on `device` and filled with N(0, 0.02)
    (norm weights 1) from a seeded generator: the same seed gives the same model."""
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    model = model.to(dtype).to_empty(device=device)   # cast on meta: no fp32 copy on the device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()
    model.init_rope(max_positions, torch.device(device), dtype)
    return model.eval()
