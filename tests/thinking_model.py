"""A tiny random model that thinks, for the reasoning, tool-calling and agent-API tests.

`build_thinking_model(path)` writes a random Llama (tinymodel.COMMON_CONFIG) whose tokenizer
is the byte-level one (any text round-trips, so JSON tool calls are writable) plus two
single tokens, "<think>" and "</think>", and whose chat template opens `<think>` in the
generation prompt as DeepSeek-R1's and Qwen3's thinking templates do, unless
`enable_thinking` is false (then the prompt closes it: `<think></think>`, Qwen3's switch).
So the random model's continuation is its "thinking" until it samples `</think>`, and what
follows is its answer. To make that happen within a few tokens, the LM head's `</think>`
row is scaled up (END_BOOST), so greedy decoding emits it where its logit is high, not
never; which conversations end their thinking, and where, is read from transformers' own
greedy decoding of the same weights (the tests' oracle), never assumed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tinymodel import COMMON_CONFIG, random_hf_model

THINK, END_THINK = "<think>", "</think>"
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
    "{% else %}<think>{% endif %}{% endif %}")
END_BOOST = 3.0


def save_thinking_tokenizer(path: Path, chat_template: str = THINKING_TEMPLATE) -> dict:
    """The byte-level tokenizer plus "<think>" and "</think>" as single (non-special, so
    decoded) tokens; returns {"vocab_size", "think", "end_think"} (ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{ch: 3 + i for i, ch in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(THINK, special=False, normalized=False),
                    AddedToken(END_THINK, special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    ids = fast.convert_tokens_to_ids([THINK, END_THINK])
    return {"vocab_size": len(fast), "think": ids[0], "end_think": ids[1]}


def build_thinking_model(path: Path, seed: int = 11, end_boost: float = END_BOOST,
                         chat_template: str = THINKING_TEMPLATE, **config) -> dict:
    """Save the model (fp32, 2 layers, untied head) and its tokenizer; returns the
    tokenizer's facts (save_thinking_tokenizer)."""
    path = Path(path)
    facts = save_thinking_tokenizer(path, chat_template)
    model = random_hf_model("LlamaConfig", {
        **COMMON_CONFIG, "vocab_size": facts["vocab_size"], "num_hidden_layers": 2,
        "tie_word_embeddings": False, "max_position_embeddings": 2048, **config}, seed)
    with torch.no_grad():
        model.lm_head.weight[facts["end_think"]] *= end_boost
    model.save_pretrained(path, safe_serialization=True)
    return facts


def hf_greedy_text(model_dir: Path, messages: list[dict], max_new_tokens: int,
                   **template_kwargs) -> tuple[list[int], str]:
    """transformers' greedy continuation of the conversation (EOS ignored): its token ids
    and their text."""
    import transformers

    from tinymodel import hf_greedy

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False, **template_kwargs)
    ids = hf_greedy(hf.eval(), list(prompt), max_new_tokens)
    return ids, tok.decode(ids)


class Oracle:
    """transformers' greedy continuation of prompts (token ids) on the model's weights,
    split at its first `</think>`."""

    def __init__(self, model_dir: Path, facts: dict):
        import transformers

        self.tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                                    dtype=torch.float32).eval()
        self.end = facts["end_think"]

    def thinking(self, prompt_ids: list[int], max_new_tokens: int) -> str | None:
        """The reasoning text before the first `</think>` of the continuation, or None when
        it does not end within `max_new_tokens`."""
        from tinymodel import hf_greedy

        ids = hf_greedy(self.hf, list(prompt_ids), max_new_tokens)
        if self.end not in ids:
            return None
        return self.tok.decode(ids[:ids.index(self.end)], skip_special_tokens=True)


def thinking_conversation(model_dir: Path, facts: dict, max_new_tokens: int = 24,
                          tries: int = 40, **template_kwargs) -> dict:
    """The first of a series of one-question conversations whose greedy continuation (per
    transformers) ends its thinking after at least one token and leaves an answer of at
    least two tokens within `max_new_tokens`: {"messages", "ids", "reasoning", "answer"}
    (texts as the engine's detokenizer gives them). Raises if none of `tries` does."""
    import transformers

    from tinymodel import hf_greedy

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    end = facts["end_think"]
    for i in range(tries):
        messages = [{"role": "user", "content": f"What is {i} plus {i + 3}?"}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **template_kwargs)
        ids = hf_greedy(hf, list(prompt), max_new_tokens)
        if end in ids and 1 <= ids.index(end) <= max_new_tokens - 3:
            k = ids.index(end)
            return {"messages": messages, "ids": ids, "prompt_ids": list(prompt),
                    "reasoning": tok.decode(ids[:k], skip_special_tokens=True),
                    "answer": tok.decode(ids[k + 1:], skip_special_tokens=True)}
    raise AssertionError(f"no conversation of {tries} ends its thinking within "
                         f"{max_new_tokens} tokens")
