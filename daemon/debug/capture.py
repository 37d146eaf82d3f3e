"""The JSONL files of the debugging loop (docs/debugging.md): a capture written by
`tokenloom admin record`, and the output of `tokenloom replay`. Pure module.

Every line is one JSON object with a `kind`:

- `header` (first line): `source` ("record" | "replay"), `version`, `started_at` (Unix
  seconds), and for a capture `content` ("body" | "tokens" | "hashes"), `block_size`, `model`.
- `request` (a capture): `t` (seconds since the capture started), `endpoint` ("completions" |
  "chat"), the prompt as `body` (the request body as sent), `prompt_token_ids` (+ `params`,
  the body without its prompt) or `blocks` (`{"hashes": [hex...], "num_tokens": N}`, the
  request's chain hashes over full blocks, + `params`), then `salt`, `tenant`, `priority`,
  `status`, `error`, `usage` and `metrics` (the server's per-request metrics, trace included).
- `response` (a replay): `index` (the capture's request it replays), `t` (its scheduled
  offset), `sent` (when it went out), `endpoint`, `tenant`, `status`, `error`, client-side
  `ttft`, `itl` (gaps between streamed chunks), `e2e`, then `usage`, `metrics` (tokenloom only)
  and `prompt_token_ids` (tokenloom only, asked of /tokenize after the replay).
- `server` (a replay, last line): counters of `/metrics` before and after, and gauges sampled
  during the replay (`samples`: `{"t", "kv_usage", "waiting", "running"}`).

Diagnosis reads either kind (`load`): a capture's own metrics are as good as a replay's,
without the client-side timings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import IO, Iterable, Iterator

VERSION = 1
CONTENT_MODES = ("body", "tokens", "hashes")


@dataclasses.dataclass
class Capture:
    header: dict
    records: list[dict]                 # `request` or `response` lines, in file order
    server: dict | None = None          # the replay's `server` line

    @property
    def source(self) -> str:
        return self.header.get("source", "record")


def iter_lines(f: IO[str]) -> Iterator[dict]:
    for number, line in enumerate(f, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "kind" not in obj:
            raise ValueError(f"line {number}: expected an object with a `kind`")
        yield obj


def load(path: str | Path) -> Capture:
    """A capture or replay output. A file cut short by a crash (last line half-written) loses
    that line only."""
    header: dict | None = None
    records: list[dict] = []
    server = None
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines = lines[:-1]
    for obj in iter_lines(iter(lines)):
        kind = obj["kind"]
        if kind == "header":
            header = obj
        elif kind in ("request", "response"):
            records.append(obj)
        elif kind == "server":
            server = obj
    if header is None:
        raise ValueError(f"{path}: no header line (not a tokenloom capture or replay output)")
    return Capture(header, records, server)


def dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n"


def write(path: str | Path, header: dict, lines: Iterable[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(dumps({"kind": "header", "version": VERSION, **header}))
        for line in lines:
            f.write(dumps(line))
