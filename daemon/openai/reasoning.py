"""Reasoning parsers: a model's thinking split from its answer, whole or as it streams.

Thinking models write their reasoning before the answer, between tags (`<think>` ...
`</think>` for Qwen3, DeepSeek-R1 and their kin). Chat completions return it as
`reasoning_content` beside `content` (vLLM's field), the Responses API as a reasoning item,
the Messages API as thinking blocks. Structured output and tool calls apply to the answer:
the request's constraint starts after the end tag (`ModelReasoning.gate`, enforced by the
runner: actors/sampling_params.ReasoningGate), and the call parser reads the answer only.

Contract of a splitter (`ThinkSplitter`, one per choice):
- `feed(text)` returns the (reasoning, answer) text it can decide; `finish()` the rest.
  Feeding a text in any pieces gives the same reasoning and answer, joined, as feeding it
  whole: text that may be the beginning of a tag is held back until a later piece (or
  `finish`) decides it.
- The output thinks from its start when the prompt opened the thinking (`opened`: the chat
  template's generation prompt ends inside `<think>`, as DeepSeek-R1's and Qwen3's thinking
  models do), or when it opens with the start tag itself (whitespace before the tag is
  dropped; so is a start tag repeated at the start of an opened output). The end tag ends
  the thinking; what follows is the answer. An output that never closes its thinking is all
  reasoning; one that never opens any is all answer (tags later in it are plain text).

Registry: `PARSERS` maps the names server.reasoning_parser and --reasoning-parser take to
parsers; "auto" picks by the served model (`for_model`). Extension point: gpt-oss's harmony
channels (`<|channel|>analysis<|message|>...<|end|>`, then the `final` channel) are one more
parser with the same `splitter(opened)` shape, chosen there by its architecture.

Pure: no asyncio, no torch.
"""

from __future__ import annotations

import dataclasses
import json

import msgspec

from tokenloom.actors.sampling_params import ReasoningGate

# Architectures whose models think in <think> tags whatever their template says.
THINK_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

_HEAD, _THINK, _ANSWER = 0, 1, 2


class ThinkSplitter:
    """One output's thinking and answer (module docstring)."""

    def __init__(self, start: str, end: str, opened: bool):
        self.start, self.end, self.opened = start, end, opened
        self._mode = _HEAD
        self._held = ""
        self.thought = opened    # the output has a reasoning part (possibly empty)

    @property
    def thinking(self) -> bool:
        """Whether text fed now would (so far as is known) be reasoning."""
        return self._mode == _THINK or (self._mode == _HEAD and self.opened)

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, answer = [], []
        buf, self._held = self._held + text, ""
        while buf:
            if self._mode == _HEAD:
                stripped = buf.lstrip()
                if stripped.startswith(self.start):
                    buf, self._mode, self.thought = stripped[len(self.start):], _THINK, True
                    continue
                if self.start.startswith(stripped):   # may still become the start tag
                    self._held = buf
                    break
                self._mode = _THINK if self.opened else _ANSWER
                continue
            if self._mode == _THINK:
                i = buf.find(self.end)
                if i >= 0:
                    reasoning.append(buf[:i])
                    buf, self._mode = buf[i + len(self.end):], _ANSWER
                    continue
                keep = _partial_tag(buf, self.end)
                reasoning.append(buf[:len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            answer.append(buf)
            break
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._mode == _HEAD:
            self._mode = _THINK if self.opened else _ANSWER
        return (held, "") if self._mode == _THINK else ("", held)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output: (reasoning, or None when it has no reasoning part; answer)."""
        r1, a1 = self.feed(text)
        r2, a2 = self.finish()
        return (r1 + r2 if self.thought else None), a1 + a2


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclasses.dataclass(frozen=True)
class TagParser:
    """Thinking between a start and an end tag."""
    name: str
    start: str = "<think>"
    end: str = "</think>"

    def splitter(self, opened: bool) -> ThinkSplitter:
        return ThinkSplitter(self.start, self.end, opened)

    def opens(self, generation_prompt: str) -> bool:
        """Whether a prompt ending in `generation_prompt` leaves the thinking open."""
        return generation_prompt.rfind(self.start) > generation_prompt.rfind(self.end)


# server.reasoning_parser's names besides "auto" and "none" (config/schema.py lists them).
PARSERS = {"think": TagParser("think"), "qwen3": TagParser("qwen3"),
           "deepseek_r1": TagParser("deepseek_r1")}
NAMES = ("auto", "none", *PARSERS)


def for_model(name: str, chat_template: str | None, architecture: str) -> TagParser | None:
    """The parser `name` stands for; "auto": the <think> parser for a model whose chat
    template emits <think> or whose architecture thinks in it, else none."""
    if name == "none":
        return None
    if name != "auto":
        return PARSERS[name]
    if architecture in THINK_ARCHITECTURES or "<think>" in (chat_template or ""):
        return PARSERS["think"]
    return None


@dataclasses.dataclass(frozen=True)
class Thinking:
    """One request's thinking: the parser, and whether its prompt opened the thinking."""
    parser: TagParser
    opened: bool

    def splitter(self) -> ThinkSplitter:
        return self.parser.splitter(self.opened)

    def split(self, text: str) -> tuple[str | None, str]:
        return self.splitter().split(text)


class ModelReasoning:
    """The served model's thinking: its parser (None: answers are not split), whether its
    chat template has Qwen3's `enable_thinking` switch, how its generation prompt leaves
    the thinking for a request's chat_template_kwargs, and its tags as token ids (for the
    gate; a tag that is not one token gets none, and a constraint then applies from the
    first token)."""

    def __init__(self, parser: TagParser | None, tokenizer):
        self.parser = parser
        self._tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.switch = isinstance(template, str) and "enable_thinking" in template
        self._opened: dict[str, bool] = {}
        self._start_id = self._end_id = None
        if parser is not None:
            self._start_id = _single_token(tokenizer, parser.start)
            self._end_id = _single_token(tokenizer, parser.end)

    def thinking(self, chat_template_kwargs: dict | None) -> Thinking | None:
        if self.parser is None:
            return None
        return Thinking(self.parser, self._opens(chat_template_kwargs))

    def gate(self, thinking: Thinking | None) -> ReasoningGate | None:
        if thinking is None or self._end_id is None:
            return None
        return ReasoningGate(end_token_id=self._end_id, opened=thinking.opened,
                             start_token_id=-1 if self._start_id is None else self._start_id)

    def with_switch(self, kwargs: dict | None, enable: bool | None) -> dict | None:
        """`kwargs` with `enable_thinking` set to `enable` where the template has the switch
        and the request did not set it itself (Responses' reasoning.effort, Messages'
        thinking)."""
        if enable is None or not self.switch or (kwargs and "enable_thinking" in kwargs):
            return kwargs
        return {**(kwargs or {}), "enable_thinking": enable}

    def _opens(self, kwargs: dict | None) -> bool:
        key = json.dumps(kwargs or {}, sort_keys=True, default=str)
        hit = self._opened.get(key)
        if hit is None:
            hit = self.parser.opens(self._generation_prompt(kwargs or {}))
            if len(self._opened) > 256:   # (kwargs are the client's: keep it bounded)
                self._opened.clear()
            self._opened[key] = hit
        return hit

    def _generation_prompt(self, kwargs: dict) -> str:
        """What the template adds for the assistant's turn, rendered on a probe message."""
        probe = [{"role": "user", "content": "x"}]
        try:
            with_prompt = self._tokenizer.apply_chat_template(
                probe, add_generation_prompt=True, tokenize=False, **kwargs)
            without = self._tokenizer.apply_chat_template(
                probe, add_generation_prompt=False, tokenize=False, **kwargs)
        except Exception:   # noqa: BLE001 - the request's own rendering reports the problem
            return ""
        if with_prompt.startswith(without):
            return with_prompt[len(without):]
        return with_prompt


def _single_token(tokenizer, text: str) -> int | None:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:   # noqa: BLE001
        return None
    return ids[0] if len(ids) == 1 else None


def with_thinking(reasoning: ModelReasoning | None, parsed):
    """`parsed` (protocol.ParsedRequest) with its thinking, and its output constraint, if
    any, gated to start after the thinking."""
    if reasoning is None or reasoning.parser is None:
        return parsed
    thinking = reasoning.thinking(parsed.chat_template_kwargs)
    params = parsed.params
    gate = reasoning.gate(thinking)
    if params.guided is not None and gate is not None:
        params = msgspec.structs.replace(
            params, guided=msgspec.structs.replace(params.guided, gate=gate))
    return dataclasses.replace(parsed, thinking=thinking, params=params)
