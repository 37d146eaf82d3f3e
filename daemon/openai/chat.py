"""POST /v1/chat/completions: chat response shapes, and tool calls.

A chat with tools the model may call (`tool_choice` other than "none") goes through the
chat template when it renders tools, else the tools are described in the system message
(daemon/openai/tools.py); the answer is parsed for calls (whole responses) or streamed in
OpenAI's incremental tool-call shape (`ToolCallStream`, daemon/openai/streaming.py).
"""

from __future__ import annotations

from aiohttp import web

from tokenloom.daemon import sse
from tokenloom.daemon.openai import protocol
from tokenloom.daemon.openai import tools as T
from tokenloom.daemon.openai.endpoints import check_serving, read_body
from tokenloom.daemon.openai.formatter import Formatter
from tokenloom.daemon.openai.generation import Choice, Delta, Generation
from tokenloom.daemon.openai.handlers import serve
from tokenloom.daemon.openai.reasoning import with_thinking
from tokenloom.daemon.state import STATE


class ChatFormatter(Formatter):
    object = "chat.completion"
    endpoint = "chat"
    chunk_object = "chat.completion.chunk"

    def __init__(self, state, request_id: str, parsed: protocol.ParsedRequest):
        super().__init__(state, request_id, parsed)
        self.calls_tools = parsed.tools is not None and parsed.tools.choice != "none"
        self.thinking = parsed.thinking   # reasoning.Thinking, or None: no split

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def logprobs(self, index: int, lps) -> dict | None:
        if self.parsed.logprobs is None:
            return None
        content = []
        for lp in lps:
            e = self._entry(lp.token_id, lp.logprob)
            e["top_logprobs"] = [self._entry(t, v) for t, v in (lp.top or ())]
            content.append(e)
        return {"content": content, "refusal": None}

    def choice(self, c: Choice, lps: dict | None) -> dict:
        calls, reason = None, "tool_calls"
        tools = self.parsed.tools
        text, thought = c.full_text, {}
        if self.thinking is not None:   # tools and structured output are the answer's
            reasoning, text = self.thinking.split(text)
            thought = {"reasoning_content": reasoning}
        if self.calls_tools and c.finish_reason == "stop":
            calls = T.parse_calls(text, tools)
        elif self.calls_tools and tools.forced and c.finish_reason:
            # A forced call cut off (e.g. by max_tokens): the calls as far as they got, as
            # the streamed response sends them, with the reason it ended.
            calls, reason = T.partial_calls(text), c.finish_reason
        if calls is None:
            content = None if not text and thought.get("reasoning_content") is not None else text
            return {"index": c.index,
                    "message": {"role": "assistant", "content": content, "refusal": None,
                                **thought},
                    "logprobs": lps, "finish_reason": c.finish_reason}
        message = {"role": "assistant", "content": None, "refusal": None, **thought}
        if calls:
            message["tool_calls"] = calls
        return {"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason}

    def delta_fields(self, d: Delta) -> dict:
        return {"delta": {"content": d.text} if d.text or d.finish_reason is None else {}}

    def frame_body(self, d: Delta) -> bytes:
        if d.text or d.finish_reason is None:
            return b'"delta":{"content":' + sse.encode(d.text) + b"}"
        return b'"delta":{}'

    def first_chunks(self, gen: Generation) -> list[dict]:
        chunks = []
        for c in gen.results():
            chunk = self._base(self.chunk_object)
            chunk["choices"] = [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]
            self.usage_slot(chunk)
            chunks.append(chunk)
        return chunks


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    check_serving(state)
    parsed = protocol.parse_chat(await read_body(request, state), state.limits,
                                 request.headers, state.config.scheduler.priority_classes)
    parsed = with_thinking(state.reasoning, parsed)
    messages, template_tools = template_inputs(state, parsed)
    return await serve(request, state, parsed, ChatFormatter, "chatcmpl", prompts=[None],
                       messages=messages, tools=template_tools)


def template_inputs(state, parsed: protocol.ParsedRequest) -> tuple[list[dict], list | None]:
    """The messages and the tools the chat template is given: the tools themselves when
    the template renders them, else described in the system message (the render endpoint
    gives the same prompt as generation: daemon/openai/render.py)."""
    messages, template_tools = parsed.messages, None
    if parsed.tools is not None and parsed.tools.choice != "none":
        if T.template_renders_tools(getattr(state.engine.tokenizer, "chat_template", None)):
            template_tools = parsed.tools.template_tools()
        else:
            messages = T.fallback_messages(messages, parsed.tools)
    return messages, template_tools
