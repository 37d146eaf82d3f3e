"""Tool calling in /v1/chat/completions: `tools` and `tool_choice` validated, the forced
cases turned into an output constraint, and the model's answer parsed into `tool_calls`.

Contract:
- `parse_tools(tools, tool_choice)` returns None (no tools) or a `ToolSpec`, or raises
  APIError naming the field (`tools[1].function.parameters`, `tool_choice`).
- The call format: one JSON call `{"name": ..., "arguments": {...}}` of an allowed
  function, or, when parallel calls are allowed (`parallel_tool_calls`, default true as in
  OpenAI's API), a JSON array of one or more of them. A forced choice constrains the
  answer to that format (`call_schema`; a named function: exactly one call of it), so
  `parse_calls` always succeeds on a complete answer. With "auto" the answer is parsed the
  same way and is a call only if it is exactly that; otherwise it is content.
- `arguments` is the model's own text of the arguments object, so the fragments streamed
  by `CallDeltas` (OpenAI's incremental shape: a first delta with id, type and name, then
  pieces of `arguments` as they are generated) join up to the non-streamed calls.
- Tools are rendered by the model's chat template when it uses `tools`; otherwise
  (`template_renders_tools` false, e.g. SmolLM2's template) `fallback_messages` describes
  them in the system message, with the call format the parser reads.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from tokenloom.daemon.errors import APIError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    functions: tuple[dict, ...]      # {"name", "description", "parameters"} each
    choice: str                      # "none" | "auto" | "required" | a function's name
    parallel: bool = True            # an answer may make several calls (a JSON array)

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    def allowed(self) -> list[dict]:
        if self.choice in CHOICES:
            return list(self.functions)
        return [f for f in self.functions if f["name"] == self.choice]

    @property
    def many(self) -> bool:
        """Whether an answer may be an array of calls (a named choice forces one call)."""
        return self.parallel and self.choice in CHOICES

    def call_schema(self) -> dict:
        """The JSON schema of a forced answer: one call of an allowed function, or (parallel
        calls allowed) an array of one or more."""
        calls = [{"type": "object",
                  "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for f in self.allowed()]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if not self.many:
            return one
        return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]}

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]


def parse_tools(tools, tool_choice, unsupported_keyword,
                parallel_tool_calls: bool | None = None) -> ToolSpec | None:
    """`unsupported_keyword(schema, path)`: protocol's check for JSON-schema keywords the
    grammar engine cannot enforce."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f"{where}.type must be \"function\"", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(400, f"{where}.function must be an object", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(400, f"{where}.function.name must be 1-64 letters, digits, _ or -, "
                                f"got {name!r}", param=f"{where}.function.name")
        if name in seen:
            raise APIError(400, f"{where}.function.name {name!r} is given twice",
                           param=f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        param = f"{where}.function.parameters"
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise APIError(400, f"{param} must be a JSON schema of type object",
                           param=param)
        params = {"type": "object", **params}
        found = unsupported_keyword(params, param)
        if found:
            raise APIError(400, f"{found[1]} uses `{found[0]}`, which tool calling does not "
                                f"support", param=param)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(400, f"{where}.function.description must be a string",
                           param=f"{where}.function.description")
        functions.append({"name": name, "description": description or "",
                          "parameters": params})
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in seen:
            raise APIError(400, f"tool_choice must name one of the tools "
                                f"({', '.join(sorted(seen))}), got {json.dumps(choice)}",
                           param="tool_choice")
        choice = name
    elif choice not in CHOICES:
        raise APIError(400, f"tool_choice must be none, auto, required or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                            f"got {choice!r}", param="tool_choice")
    return ToolSpec(tuple(functions), choice, parallel_tool_calls is not False)


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def fallback_messages(messages: list[dict], spec: ToolSpec) -> list[dict]:
    """The conversation with the tools described in its system message (for templates that
    do not render `tools`)."""
    listing = json.dumps([{"name": f["name"], "description": f["description"],
                           "parameters": f["parameters"]} for f in spec.allowed()])
    if spec.forced:
        how = "Call one of them: answer with only"
    else:
        how = "To call one, answer with only"
    text = (f"You can call these functions: {listing}\n{how} a JSON object "
            '{"name": <function name>, "arguments": <arguments object>}.')
    if spec.many:
        text += " To make several calls at once, answer with a JSON array of such objects."
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def parse_calls(text: str, spec: ToolSpec) -> list[dict] | None:
    """OpenAI `tool_calls` entries when `text` is exactly an answer in the call format
    (module docstring), else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(value, list) and spec.many:
        items = value
    elif isinstance(value, dict):
        items = [value]
    else:
        return None
    allowed = {f["name"] for f in spec.allowed()}
    if not items or not all(isinstance(v, dict) and set(v) == {"name", "arguments"}
                            and v["name"] in allowed and isinstance(v["arguments"], dict)
                            for v in items):
        return None
    scanned = scan_calls(text)
    assert len(scanned) == len(items) and all(c.args_done for c in scanned), text
    return [new_call(c.name, c.arguments) for c in scanned]


def partial_calls(text: str) -> list[dict]:
    """The calls of an answer in the call format that was cut off (max_tokens, a stop
    string): every call whose name is complete, with its arguments' text as far as it
    goes. What a streamed response has sent of them by then (CallDeltas), so the
    non-streamed response of a forced tool choice says the same."""
    return [new_call(c.name, c.arguments) for c in scan_calls(text) if c.name is not None]


def new_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclasses.dataclass
class ScannedCall:
    name: str | None        # None until its string is complete
    arguments: str          # the arguments object's text so far
    args_done: bool


def scan_calls(text: str) -> list[ScannedCall]:
    """The calls of a (possibly unfinished) answer in the call format, as far as `text`
    goes: each call's name once its string is complete, and its arguments' text so far.
    Tolerant: stops at the first thing that is not the call format."""
    calls: list[ScannedCall] = []
    n, i = len(text), _ws(text, 0)
    many = i < n and text[i] == "["
    if many:
        i = _ws(text, i + 1)
    while i < n and text[i] == "{":
        call = ScannedCall(None, "", False)
        calls.append(call)
        i = _ws(text, i + 1)
        while i < n and text[i] == '"':
            key, i = _string(text, i)
            if key is None:
                return calls
            i = _ws(text, i)
            if i >= n or text[i] != ":":
                return calls
            i = _ws(text, i + 1)
            end = _value_end(text, i)
            if key == "arguments":
                call.arguments = text[i:end if end is not None else n]
                call.args_done = end is not None
            elif key == "name" and i < n and text[i] == '"':
                call.name, _ = _string(text, i)
            if end is None:
                return calls
            i = _ws(text, end)
            if i < n and text[i] == ",":
                i = _ws(text, i + 1)
        if i >= n or text[i] != "}" or not many:
            return calls
        i = _ws(text, i + 1)
        if i < n and text[i] == ",":
            i = _ws(text, i + 1)
    return calls


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string(text: str, i: int) -> tuple[str | None, int]:
    """The JSON string starting at text[i] == '"' and the index after it; (None, i) when
    it is not complete yet."""
    try:
        return json.decoder.scanstring(text, i + 1)
    except ValueError:
        return None, i


def _value_end(text: str, i: int) -> int | None:
    """The index after the JSON value starting at text[i], or None when it is not complete
    (an object or array not closed yet, a string or a literal that may go on)."""
    n = len(text)
    if i >= n:
        return None
    if text[i] == '"':
        s, end = _string(text, i)
        return None if s is None else end
    if text[i] not in "{[":
        j = i
        while j < n and text[j] not in ",}] \t\r\n":
            j += 1
        return j if j < n else None
    depth, j = 0, i
    while j < n:
        ch = text[j]
        if ch == '"':
            s, end = _string(text, j)
            if s is None:
                return None
            j = end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


class CallDeltas:
    """One choice's streamed tool calls: `feed(text)` takes the answer so far and returns
    the OpenAI `delta.tool_calls` entries that are new: for each call, once its name is
    known, {"index", "id", "type", "function": {"name", "arguments": ""}}, then
    {"index", "function": {"arguments": fragment}} as its arguments grow."""

    def __init__(self):
        self.sent: list[int] = []     # per announced call: characters of arguments sent
        self.calls: list[dict] = []   # the calls as announced (id, name)

    def feed(self, text: str) -> list[dict]:
        out = []
        for k, c in enumerate(scan_calls(text)):
            if c.name is None:
                break
            if k == len(self.sent):
                call = new_call(c.name, "")
                self.calls.append(call)
                self.sent.append(0)
                out.append({"index": k, **call, "function": {"name": c.name, "arguments": ""}})
            if len(c.arguments) > self.sent[k]:
                out.append({"index": k, "function": {"arguments": c.arguments[self.sent[k]:]}})
                self.sent[k] = len(c.arguments)
        return out
