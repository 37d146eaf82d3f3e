"""Tiny randomly-initialised models saved as real model directories, for fast tests.

`build_tiny_model(path, "LlamaConfig", {...}, seed)` writes config.json + model.safetensors + a
small word-level tokenizer ("<unk>", "<s>", "</s>", then "w3" ... "w255"), loadable both by
`transformers` and by tokenloom. Importable from any test module (conftest puts tests/ on
sys.path).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import torch

VOCAB = 256            # tokenizer and model vocabulary; ids 0-2 are <unk>, <s>, </s>
COMMON_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     initializer_range=0.3, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# A minimal chat template for the word-level tokenizer: every message's content, then the
# generation prompt "w3" (contents must be made of vocabulary words, e.g. "w17 w42").
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}w3{% endif %}")


def save_tiny_tokenizer(path: Path, chat_template: str | None = None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)


def save_byte_tokenizer(path: Path, chat_template: str | None = None) -> int:
    """A byte-level tokenizer ("<unk>", "<s>", "</s>", then one token per byte, no merges):
    any text round-trips through it, as clients that synthesise prompts by decoding token
    ids need (guidellm). Returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return len(vocab)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A tiny checkpoint to build (`config_class` of transformers with `config` over
    COMMON_CONFIG, random weights from `seed`) and the lengths of its test prompts."""
    config_class: str
    config: dict
    prompt_lens: tuple[int, ...]
    seed: int


def build_variant(path: Path, v: Variant, **hf_options) -> tuple[object, list[list[int]]]:
    """Save `v` at `path`; returns transformers' model loaded back from it (fp32, eval;
    `hf_options` for from_pretrained) and its prompts (random ids, seeded by `v.seed`)."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(path, v.config_class, v.config, v.seed)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **hf_options).eval()
    rng = random.Random(v.seed)
    return hf, [[rng.randrange(3, VOCAB) for _ in range(n)] for n in v.prompt_lens]


def random_hf_model(config_class: str, config: dict, seed: int):
    """transformers' fp32 model of `config_class(**config)`, randomly initialised from
    `seed`, with norm weights around 1 and biases that count (random init leaves them 0)."""
    import transformers

    cfg = getattr(transformers, config_class)(**config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("_proj.bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return model


def build_tiny_model(path: Path, config_class: str, config: dict, seed: int,
                     chat_template: str | None = None, byte_tokenizer: bool = False) -> None:
    """Save a randomly initialised fp32 model (config.json + model.safetensors + tokenizer:
    the word-level one, or with `byte_tokenizer` the byte-level one)."""
    if byte_tokenizer:
        config = {**config, "vocab_size": 3 + 256}
    model = random_hf_model(config_class, {**COMMON_CONFIG, **config}, seed)
    model.save_pretrained(path, safe_serialization=True)
    if byte_tokenizer:
        save_byte_tokenizer(path, chat_template)
    else:
        save_tiny_tokenizer(path, chat_template)


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` by the model `hf`, never stopping
    early (no EOS), as the oracle of the parity tests."""
    ids = torch.tensor([prompt], device=hf.device)
    with torch.inference_mode():
        out = hf.generate(ids, do_sample=False, max_new_tokens=max_new_tokens,
                          eos_token_id=None, pad_token_id=0,
                          attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def build_random_adapter(base_dir: Path, path: Path, rank: int, seed: int,
                         targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                                     "gate_proj", "up_proj", "down_proj"),
                         alpha: float = 16.0, use_rslora: bool = False,
                         scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter for the model at `base_dir`, written by PEFT itself
    (adapter_config.json + adapter_model.safetensors), with random A and B (PEFT starts B at
    zero, which would make every adapter the base model)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha,
                                                 target_modules=list(targets),
                                                 use_rslora=use_rslora, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(path)
    return path


def peft_oracle(base_dir: Path, adapter_dir: Path | None):
    """transformers' model with the adapter applied by PEFT (None: the base model), eval mode."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir)
    return model.eval()
