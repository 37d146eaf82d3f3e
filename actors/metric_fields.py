"""How a stats field is exported to Prometheus: declared on the field itself.

A stats Struct (actors/messages.py, actors/kv/prefix_cache.py) annotates each field it
exports, e.g. `waiting: Annotated[int, gauge("vllm:num_requests_waiting", "...")]`; the
collector (daemon/metrics.py) walks the typed `EngineStats` and exports every annotated field,
so a new counter is one annotated field plus the line that fills it. Pure: no asyncio, no
torch, no prometheus_client.

Shapes: a number (or bool) is one sample; with `label` and `value` it is the sample
`{label=value}` of a family several fields share (same name); a `dict[str, number]` is one
sample per key under `label`; a `list[number]` one sample per index under `label`.
"""

from __future__ import annotations

import dataclasses
import typing


@dataclasses.dataclass(frozen=True)
class Metric:
    kind: str                 # "gauge" | "counter"
    name: str                 # the Prometheus name, vLLM's where one exists
    doc: str
    label: str | None = None  # dict / list fields: the label their keys or indexes go under
    value: str | None = None  # a number field sharing a family: its value of `label`


def gauge(name: str, doc: str, label: str | None = None, value: str | None = None) -> Metric:
    return Metric("gauge", name, doc, label, value)


def counter(name: str, doc: str, label: str | None = None, value: str | None = None) -> Metric:
    return Metric("counter", name, doc, label, value)


def exported_fields(cls: type) -> list[tuple[str, Metric]]:
    """(field name, Metric) for every field of `cls` annotated with a Metric, in field order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for name in getattr(cls, "__struct_fields__", ()):
        for extra in getattr(hints.get(name), "__metadata__", ()):
            if isinstance(extra, Metric):
                out.append((name, extra))
    return out
