"""The two prompt forms an OpenAI body carries, validated into what the tokenizer takes:
completions' `prompt` (a string, token ids, or a list of either) and chat's `messages` (the
`ChatMessage` structs here, to plain dicts for the chat template). Errors are `APIError`s
naming the field at fault (`prompt[2]`, `messages[1].role`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tokenloom.daemon.errors import APIError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    """One chat message as a body carries it (chat completions, /tokenize)."""
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None         # a tool message: the call it answers


def completion_prompts(prompt) -> list[str | list[int]]:
    def is_tokens(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in x)

    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and is_tokens(prompt):
        prompts = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif prompt and all(isinstance(p, list) and is_tokens(p) for p in prompt):
        prompts = list(prompt)
    elif not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    else:
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids "
                            "or a list of token-id lists", param="prompt")
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not p:
            raise APIError(400, f"{where} is empty", param=where)
        if isinstance(p, list) and any(t < 0 for t in p):
            raise APIError(400, f"{where} has a negative token id", param=where)
    return prompts


def chat_messages(messages: list[ChatMessage], param: str = "messages") -> list[dict]:
    """Messages as plain dicts for the chat template; text parts are joined."""
    if not messages:
        raise APIError(400, f"{param} is empty", param=param)
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise APIError(400, f"{param}[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                f"got {m.role!r}", param=f"{param}[{i}].role")
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"only text content parts are supported, got "
                                        f"{part.type!r}", param=f"{param}[{i}].content[{j}]")
                texts.append(part.text)
            content = "".join(texts)
        if m.tool_calls:
            # Earlier calls, written the way the model is asked to make them (several: an
            # array), after any text the turn began with (agents often write both).
            calls = [{"name": (c.get("function") or {}).get("name"),
                      "arguments": _arguments((c.get("function") or {}).get("arguments"))}
                     for c in m.tool_calls if isinstance(c, dict)]
            if calls:
                written = json.dumps(calls[0] if len(calls) == 1 else calls)
                content = f"{content}\n{written}" if content else written
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _arguments(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text
