"""One choice's output as the agent APIs present it: thinking, answer text and tool calls.

The Responses and Messages APIs (responses_api.py, messages_api.py) differ in their shapes,
not in what an output is: `AnswerStream` turns the engine's text deltas into a short list
of `Event`s — reasoning text, answer text, a call that starts (id, name), a fragment of a
call's arguments — and keeps the whole answer for the final response, so a streamed and a
non-streamed response say the same. Each API's formatter turns the events into its own
stream events and the final state into its own response object.

The rules are chat's (streaming.ToolCallStream, chat.ChatFormatter.choice): thinking is
split off first (reasoning.py) and tools apply to the answer only; a forced tool choice's
answer is in the call format by construction and its calls are streamed as generated; with
"auto" the answer is held back while it may be a call (empty, or starting with "{" or "[")
and becomes calls only if, finished, it is exactly the call format (tools.py).
"""

from __future__ import annotations

import dataclasses

from tokenloom.daemon.openai import tools as T
from tokenloom.daemon.openai.generation import Delta
from tokenloom.daemon.openai.reasoning import Thinking

REASONING, TEXT, CALL, ARGS = "reasoning", "text", "call", "args"


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str            # REASONING | TEXT | CALL (a call starts) | ARGS (arguments grow)
    text: str = ""       # REASONING / TEXT / ARGS: the new text
    index: int = 0       # CALL / ARGS: the call's index in the answer
    call_id: str = ""    # CALL
    name: str = ""       # CALL


@dataclasses.dataclass
class Call:
    id: str
    name: str
    arguments: str       # the model's text of the arguments object (complete unless cut)


class AnswerStream:
    def __init__(self, thinking: Thinking | None, tools: T.ToolSpec | None):
        self.splitter = thinking.splitter() if thinking is not None else None
        self.tools = tools if tools is not None and tools.choice != "none" else None
        self.reasoning: list[str] = []
        self.content: list[str] = []       # the answer's text, as generated
        self.calls: list[Call] = []
        self.finish_reason: str | None = None   # the engine's
        self.reasoning_tokens = 0          # output tokens spent thinking (end tag included)
        self._passing = self.tools is None  # answer text goes out as it comes
        self._deltas = T.CallDeltas()

    # -- what the response reports -------------------------------------------------------
    @property
    def thought(self) -> bool:
        return self.splitter is not None and self.splitter.thought

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    @property
    def text(self) -> str:
        """The answer's text; empty when the answer is calls."""
        return "" if self.calls or (self.tools is not None and self.tools.forced) \
            else "".join(self.content)

    @property
    def stop(self) -> str | None:
        """Why the answer ended: "tool_calls" when it made calls and was not cut off, else
        the engine's finish reason ("stop", "length", ...)."""
        if self.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    # -- feeding -------------------------------------------------------------------------
    def feed(self, d: Delta) -> list[Event]:
        if self.splitter is None:
            reasoning, answer = "", d.text
        else:
            thinking = self.splitter.thinking
            reasoning, answer = self.splitter.feed(d.text)
            if d.finish_reason is not None:
                more = self.splitter.finish()
                reasoning, answer = reasoning + more[0], answer + more[1]
            if thinking or reasoning:
                self.reasoning_tokens += len(d.token_ids)
        events = []
        if reasoning:
            self.reasoning.append(reasoning)
            events.append(Event(REASONING, reasoning))
        if answer:
            events.extend(self._answer(answer))
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            events.extend(self._finish())
        return events

    def _answer(self, text: str) -> list[Event]:
        self.content.append(text)
        if self._passing:
            return [Event(TEXT, text)]
        so_far = "".join(self.content)
        if self.tools.forced:
            return self._call_events(self._deltas.feed(so_far))
        if so_far.lstrip()[:1] in ("", "{", "["):   # may still be a call: hold it back
            return []
        self._passing = True
        return [Event(TEXT, so_far)]

    def _finish(self) -> list[Event]:
        if self._passing:
            return []
        text = "".join(self.content)
        if self.tools.forced:   # its calls went out as generated; complete them
            self._take_calls(text)
            return []
        if self.finish_reason == "stop" and T.parse_calls(text, self.tools) is not None:
            events, so_far = [], ""
            for piece in self.content:   # one argument fragment per generated piece
                so_far += piece
                events.extend(self._call_events(self._deltas.feed(so_far)))
            self._take_calls(text)
            return events
        self._passing = True
        return [Event(TEXT, text)] if text else []

    def _take_calls(self, text: str) -> None:
        scanned = [c for c in T.scan_calls(text) if c.name is not None]
        self.calls = [Call(sent["id"], sent["function"]["name"], scanned[k].arguments)
                      for k, sent in enumerate(self._deltas.calls) if k < len(scanned)]

    @staticmethod
    def _call_events(entries: list[dict]) -> list[Event]:
        out = []
        for e in entries:
            fn = e["function"]
            if "id" in e:
                out.append(Event(CALL, index=e["index"], call_id=e["id"], name=fn["name"]))
            if fn.get("arguments"):
                out.append(Event(ARGS, fn["arguments"], index=e["index"]))
        return out
