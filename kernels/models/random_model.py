"""Random-weight models of named shapes, for benchmarks and GPU checks.

The GPU machine has no network and no checkpoints, so the GPU check builds models of real
shapes (SmolLM2-135M, Llama-3-8B) with random weights on the device (`random_model`, torch
only), or writes one as a Hugging Face directory for the real engine to load
(`write_checkpoint`; also needs safetensors, tokenizers and transformers). Timing does not
depend on the values; a std of 0.02 keeps activations finite through every layer in bf16.
"""

from __future__ import annotations

import torch

from tokenloom.kernels.models.decoder import CausalLM
from tokenloom.kernels.models.model_spec import ModelSpec, RopeSpec

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
    if spec.o_bias:
        attn += h
    layer = attn + 3 * h * i + 2 * h
    head = 0 if spec.tie_word_embeddings else v * h
    return v * h + spec.num_layers * layer + h + head


def random_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str,
                 max_positions: int, seed: int = 0) -> CausalLM:
    """Built on the meta device, materialised on `device` and filled with N(0, 0.02)
    (norm weights 1) from a seeded generator: the same seed gives the same model."""
    with torch.device("meta"):
        model = CausalLM(spec)
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


# -- a random checkpoint on disk ---------------------------------------------------------------
def hf_config_fields(spec: ModelSpec) -> dict:
    """`transformers.LlamaConfig` keyword arguments that `spec_from_hf_config` maps back to
    `spec` (the round trip is tested)."""
    rope = {"rope_type": spec.rope.rope_type, "rope_theta": spec.rope.theta}
    if spec.rope.rope_type == "llama3":
        rope.update(factor=spec.rope.factor, low_freq_factor=spec.rope.low_freq_factor,
                    high_freq_factor=spec.rope.high_freq_factor,
                    original_max_position_embeddings=spec.rope.original_max_position_embeddings)
    elif spec.rope.rope_type == "linear":
        rope.update(factor=spec.rope.factor)
    eos = list(spec.eos_token_ids)
    return dict(architectures=[spec.architecture], vocab_size=spec.vocab_size,
                hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                rms_norm_eps=spec.rms_norm_eps,
                max_position_embeddings=spec.max_position_embeddings,
                tie_word_embeddings=spec.tie_word_embeddings, attention_bias=spec.attention_bias,
                bos_token_id=spec.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos,
                rope_theta=spec.rope.theta, rope_scaling=rope)


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The Hugging Face Llama checkpoint's tensor names and shapes (what loader.py fuses)."""
    h, i = spec.hidden_size, spec.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h),
                                       "model.norm.weight": (h,)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        for proj, rows in (("q", spec.q_size), ("k", spec.kv_size), ("v", spec.kv_size)):
            out[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if spec.attention_bias:
                out[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        out[f"{p}self_attn.o_proj.weight"] = (h, spec.q_size)
        if spec.o_bias:
            out[f"{p}self_attn.o_proj.bias"] = (h,)
        out[f"{p}mlp.gate_proj.weight"] = (i, h)
        out[f"{p}mlp.up_proj.weight"] = (i, h)
        out[f"{p}mlp.down_proj.weight"] = (h, i)
        out[f"{p}input_layernorm.weight"] = (h,)
        out[f"{p}post_attention_layernorm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


def token_names(spec: ModelSpec) -> list[str]:
    """One name per id, so that every id the random model can sample decodes: "<s>" at the
    BOS id, "</s>" (then "</s1>", ...) at the EOS ids, "<unk>" at id 0 when it is free,
    "t{id}" elsewhere."""
    names = [f"t{i}" for i in range(spec.vocab_size)]
    if spec.bos_token_id is not None:
        names[spec.bos_token_id] = "<s>"
    for k, eos in enumerate(spec.eos_token_ids):
        names[eos] = "</s>" if k == 0 else f"</s{k}>"
    if names[0] == "t0":
        names[0] = "<unk>"
    return names


# Enough for /v1/chat/completions: each message's words, then the generation prompt "t3".
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")


def save_word_tokenizer(spec: ModelSpec, path) -> None:
    """A word-level tokenizer over `token_names(spec)` (whitespace-separated words; a word
    outside the vocabulary is <unk>, or the first name when id 0 is special), saved as
    tokenizer.json + tokenizer_config.json: no download, no merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = token_names(spec)
    unk = "<unk>" if "<unk>" in names else names[0]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"unk_token": unk}
    if spec.bos_token_id is not None:
        special["bos_token"] = "<s>"
    if spec.eos_token_ids:
        special["eos_token"] = "</s>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **special,
                                   model_max_length=spec.max_position_embeddings)
    extra = [f"</s{k}>" for k in range(1, len(spec.eos_token_ids))]
    if extra:
        fast.add_special_tokens({"additional_special_tokens": extra})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_checkpoint(spec: ModelSpec, path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     std: float = 0.02) -> None:
    """Save a random model of shape `spec` as a Hugging Face directory that both
    `kernels/models/loader.py` and transformers load: config.json, model.safetensors (HF names,
    q/k/v and gate/up unfused; N(0, std), norm weights 1, biases 0, from a seeded CPU
    generator: the same arguments give the same bytes) and a word-level tokenizer.
    The GPU host cannot carry real checkpoints; this writes one of the right shape there."""
    from pathlib import Path

    from safetensors.torch import save_file
    from transformers import LlamaConfig

    if spec.family != "llama":
        raise ValueError(f"write_checkpoint writes Llama-family configs, not {spec.family!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**hf_config_fields(spec))
    # transformers >= 4.56 names it `dtype`, older versions `torch_dtype`
    setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype",
            str(dtype).removeprefix("torch."))
    cfg.save_pretrained(str(path))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in hf_tensor_shapes(spec).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            state[name] = torch.zeros(shape, dtype=dtype)
        else:
            state[name] = torch.empty(shape).normal_(0.0, std, generator=gen).to(dtype)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    save_word_tokenizer(spec, path)
