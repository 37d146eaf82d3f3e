"""Structured-output fields of a request body (`response_format`, vLLM's guided_regex /
guided_choice / guided_grammar) -> one GuidedDecoding, or APIError naming the field.

The grammar itself is compiled, and so fully checked, by the tokenizer actor off the event
loop; here only what the body says is checked (one constraint, non-empty, a schema that uses
no keyword the grammar engine cannot enforce).
"""

from __future__ import annotations

import msgspec

from tokenloom.actors.sampling_params import GuidedDecoding
from tokenloom.daemon.errors import APIError


# JSON-schema keywords the grammar engine cannot enforce: refused (400) rather than ignored,
# so an output that "matches the schema" never silently breaks one of them.
UNSUPPORTED_SCHEMA_KEYWORDS = ("patternProperties", "propertyNames", "dependentSchemas",
                               "dependentRequired", "dependencies", "if", "then", "else",
                               "not", "contains", "minContains", "maxContains",
                               "unevaluatedProperties", "unevaluatedItems", "uniqueItems",
                               "multipleOf")


def unsupported_keyword(schema, path: str) -> tuple[str, str] | None:
    """The first (keyword, path) of `schema` outside what the engine enforces."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            found = unsupported_keyword(sub, f"{path}[{i}]")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            # Property names are data, not keywords.
            for name, sub in value.items():
                found = unsupported_keyword(sub, f"{path}.{key}.{name}")
                if found:
                    return found
            continue
        if key in ("enum", "const", "default", "examples", "required", "description",
                   "title"):
            continue
        if key in UNSUPPORTED_SCHEMA_KEYWORDS:
            return key, path
        found = unsupported_keyword(value, f"{path}.{key}")
        if found:
            return found
    return None


def _json_schema_spec(rf: dict) -> str:
    param = "response_format.json_schema"
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise APIError(400, f"{param} must be an object with a `schema`", param=param)
    schema = js.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{param}.schema must be a JSON schema object, got "
                            f"{type(schema).__name__}", param=f"{param}.schema")
    if isinstance(schema, dict) and "type" in schema and not isinstance(
            schema["type"], (str, list)):
        raise APIError(400, f"{param}.schema.type must be a string or a list",
                       param=f"{param}.schema")
    found = unsupported_keyword(schema, f"{param}.schema")
    if found:
        keyword, where = found
        raise APIError(400, f"{where} uses `{keyword}`, which structured output does not "
                            f"support", param=f"{param}.schema")
    return msgspec.json.encode(schema).decode()


def guided_decoding(req) -> GuidedDecoding | None:
    """The request's output constraint from `response_format` or a guided_* field (at
    most one). The grammar itself is compiled, and so fully checked, by the tokenizer actor
    off the event loop; a failure there is a 400 naming the same field."""
    given = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            given.append(("response_format", GuidedDecoding("json_object")))
        elif kind == "json_schema":
            given.append(("response_format", GuidedDecoding("json_schema",
                                                            _json_schema_spec(rf))))
        elif kind != "text":
            raise APIError(400, "response_format.type must be text, json_object or "
                                f"json_schema, got {kind!r}", param="response_format.type")
    if req.guided_regex is not None:
        if not req.guided_regex:
            raise APIError(400, "guided_regex must be non-empty", param="guided_regex")
        given.append(("guided_regex", GuidedDecoding("regex", req.guided_regex)))
    if req.guided_choice is not None:
        if not req.guided_choice or not all(req.guided_choice):
            raise APIError(400, "guided_choice must be a non-empty list of non-empty strings",
                           param="guided_choice")
        given.append(("guided_choice", GuidedDecoding(
            "choice", msgspec.json.encode(req.guided_choice).decode())))
    if req.guided_grammar is not None:
        if not req.guided_grammar.strip():
            raise APIError(400, "guided_grammar must be non-empty", param="guided_grammar")
        given.append(("guided_grammar", GuidedDecoding("grammar", req.guided_grammar)))
    if len(given) > 1:
        raise APIError(400, f"{given[1][0]} cannot be combined with {given[0][0]}: give one "
                            "output constraint", param=given[1][0])
    return given[0][1] if given else None
