"""Tool calling in /v1/chat/completions: `tools` and `tool_choice` validated, the forced
cases turned into an output constraint, and the model's answer parsed into `tool_calls`.

Contract:
- `parse_tools(tools, tool_choice)` returns None (no tools) or a `ToolSpec`, or raises
  APIError naming the field (`tools[1].function.parameters`, `tool_choice`).
- A forced choice ("required", or a named function) constrains the answer to one JSON
  call `{"name": ..., "arguments": {...}}` of an allowed function (`call_schema`), so
  `parse_call` always succeeds on a complete answer. With "auto" the answer is parsed the same
  way and is a call only if it is exactly one such object; otherwise it is content.
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

    def call_schema(self) -> dict:
        """The JSON schema of one call of an allowed function."""
        calls = [{"type": "object",
                  "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for f in self.allowed()]
        return calls[0] if len(calls) == 1 else {"anyOf": calls}

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]


def parse_tools(tools, tool_choice, unsupported_keyword) -> ToolSpec | None:
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
    return ToolSpec(tuple(functions), choice)


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
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{text}"
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def parse_call(text: str, spec: ToolSpec) -> dict | None:
    """An OpenAI `tool_calls` entry when `text` is exactly one call of an allowed function."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    allowed = {f["name"] for f in spec.allowed()}
    if not (isinstance(value, dict) and set(value) == {"name", "arguments"}
            and value["name"] in allowed and isinstance(value["arguments"], dict)):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(value["arguments"])}}
