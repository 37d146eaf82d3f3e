"""Reasoning parsers without a server (daemon/openai/reasoning.py): the <think> splitter gives
the same reasoning and answer whatever the chunk boundaries (every split point of every
case, one and two cuts, and one character at a time), the output's start decides whether
it thinks, the registry picks by the model, and the template's generation prompt says
whether a request's thinking is open (per chat_template_kwargs)."""

from __future__ import annotations

import pytest

from tokenloom.daemon.openai.reasoning import (
    NAMES,
    PARSERS,
    ModelReasoning,
    TagParser,
    for_model,
)

PARSER = TagParser("think")

# (output, opened by the prompt, reasoning (None: no reasoning part), answer)
CASES = [
    ("<think>plan it</think>The answer.", False, "plan it", "The answer."),
    ("\n<think>a</think>\n\nb", False, "a", "\n\nb"),
    ("plain answer", False, None, "plain answer"),
    ("  plain answer", False, None, "  plain answer"),
    ("answer with </think> inside", False, None, "answer with </think> inside"),
    ("answer with <think> later", False, None, "answer with <think> later"),
    ("<thin", False, None, "<thin"),
    ("<think>never closed", False, "never closed", ""),
    ("<think></think>", False, "", ""),
    ("thinking</think>answer", True, "thinking", "answer"),
    ("<think>again</think>answer", True, "again", "answer"),
    ("all thought", True, "all thought", ""),
    ("x</th", True, "x</th", ""),
    ("a</thinking>b</think>c", True, "a</thinking>b", "c"),
    ("<</think><</think>", True, "<", "<</think>"),
    ("", False, None, ""),
    ("", True, "", ""),
    ("ünïcode ✓</think>日本", True, "ünïcode ✓", "日本"),
]


def _fed(pieces: list[str], opened: bool) -> tuple[str | None, str]:
    s = PARSER.splitter(opened)
    reasoning, answer = "", ""
    for piece in pieces:
        r, a = s.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = s.finish()
    return (reasoning + r if s.thought else None), answer + a


@pytest.mark.parametrize("text, opened, reasoning, answer", CASES)
def test_whole_outputs(text, opened, reasoning, answer):
    assert PARSER.splitter(opened).split(text) == (reasoning, answer)


@pytest.mark.parametrize("text, opened, reasoning, answer", CASES)
def test_every_chunk_boundary_gives_the_same_split(text, opened, reasoning, answer):
    n = len(text)
    for i in range(n + 1):
        assert _fed([text[:i], text[i:]], opened) == (reasoning, answer), i
        for j in range(i, n + 1):
            assert _fed([text[:i], text[i:j], text[j:]], opened) == (reasoning, answer), (i, j)
    assert _fed(list(text), opened) == (reasoning, answer)


def test_reasoning_streams_out_before_the_end_tag_arrives():
    s = PARSER.splitter(False)
    assert s.feed("<thi") == ("", "")           # may be the start tag: held
    assert s.feed("nk>step one") == ("step one", "")
    assert s.thinking
    assert s.feed(" two</") == (" two", "")    # "</" may start the end tag: held
    assert s.feed("think>ok") == ("", "ok")
    assert not s.thinking and s.finish() == ("", "")


def test_the_registry_and_auto():
    assert set(NAMES) == {"auto", "none", *PARSERS}
    assert for_model("none", "<think>", "Qwen3ForCausalLM") is None
    assert for_model("auto", "{{ '<think>' }}", "LlamaForCausalLM").name == "think"
    assert for_model("auto", "{{ m.content }}", "Qwen3ForCausalLM").name == "think"
    assert for_model("auto", "{{ m.content }}", "LlamaForCausalLM") is None
    assert for_model("auto", None, "LlamaForCausalLM") is None
    assert for_model("deepseek_r1", None, "LlamaForCausalLM").name == "deepseek_r1"


def test_config_names_are_the_registry():
    import typing

    from tokenloom.config.schema import ServerConfig
    hint = typing.get_type_hints(ServerConfig)["reasoning_parser"]
    assert set(typing.get_args(hint)) == set(NAMES)


class _Tokenizer:
    """A chat template's rendering as transformers' tokenizers give it (just enough)."""
    chat_template = "... enable_thinking ..."

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        assert not tokenize
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if add_generation_prompt:
            text += "<assistant>" + ("<think></think>" if kwargs.get("enable_thinking") is False
                                     else "<think>\n")
        return text

    def encode(self, text, add_special_tokens):
        return {"<think>": [5], "</think>": [6]}.get(text, [1, 2])


def test_the_generation_prompt_says_whether_thinking_is_open():
    r = ModelReasoning(PARSER, _Tokenizer())
    assert r.switch
    assert r.thinking(None).opened and r.thinking({"enable_thinking": True}).opened
    assert not r.thinking({"enable_thinking": False}).opened
    gate = r.gate(r.thinking(None))
    assert (gate.end_token_id, gate.start_token_id, gate.opened) == (6, 5, True)
    assert not r.gate(r.thinking({"enable_thinking": False})).opened
    # The switch is set where the request did not set it itself.
    assert r.with_switch(None, False) == {"enable_thinking": False}
    assert r.with_switch({"enable_thinking": True}, False) == {"enable_thinking": True}
    assert r.with_switch({"x": 1}, None) == {"x": 1}


def test_no_parser_means_no_thinking_and_tags_of_several_tokens_mean_no_gate():
    assert ModelReasoning(None, _Tokenizer()).thinking(None) is None

    class Wide(_Tokenizer):
        def encode(self, text, add_special_tokens):
            return [1, 2, 3]

    r = ModelReasoning(PARSER, Wide())
    assert r.thinking(None) is not None and r.gate(r.thinking(None)) is None
