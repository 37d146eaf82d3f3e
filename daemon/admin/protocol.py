"""The admin channel's wire format: newline-delimited JSON, one command per line, one reply
per command, as msgspec tagged unions (no torch, no asyncio: the CLI imports this too).

    → {"cmd": "stats"}
    ← {"reply": "stats", "ok": true, "ready": true, "waiting": 0, ...}
    → {"cmd": "flush-cache", "force": false}
    ← {"reply": "error", "ok": false, "code": "refused", "error": "2 request(s) running; ..."}

Commands: stats, flush-cache {force}, drain {timeout, wait}, resume, cancel {request_id},
trace {request_id}, log-level {level}, record-start {path, content, max_bytes},
record-stop. Every reply has `ok`; failures are ErrorReply with a
`code` from ERROR_CODES.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from tokenloom.actors.messages import EngineStats

LogLevel = Literal["debug", "info", "warning", "error"]


# -- commands -----------------------------------------------------------------------------
class _Command(msgspec.Struct, tag_field="cmd", forbid_unknown_fields=True, kw_only=True,
               frozen=True):
    pass


class Stats(_Command, tag="stats"):
    pass


class FlushCache(_Command, tag="flush-cache"):
    force: bool = False  # flush even while requests run (their blocks in use stay cached)


class Drain(_Command, tag="drain"):
    # Past this many seconds the requests still running end with an error; None: no limit.
    timeout: float | None = msgspec.field(default=None)
    wait: bool = False   # reply once drained (or timed out / resumed), not at once

    def __post_init__(self) -> None:
        if self.timeout is not None and not 0 <= self.timeout <= 86400:
            raise ValueError("timeout must be >= 0 and <= 86400 seconds")


class Resume(_Command, tag="resume"):
    pass


class Cancel(_Command, tag="cancel"):
    request_id: str


class Trace(_Command, tag="trace"):
    request_id: str


class SetLogLevel(_Command, tag="log-level"):
    level: LogLevel


class RecordStart(_Command, tag="record-start"):
    """Record live traffic into `path` (on the daemon's host; the CLI sends it absolute)."""
    path: str
    content: Literal["body", "tokens", "hashes"] = "body"
    max_bytes: int | None = None        # None: record.max_bytes

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must name the capture file")
        if self.max_bytes is not None and self.max_bytes < 4096:
            raise ValueError("max_bytes must be >= 4096")


class RecordStop(_Command, tag="record-stop"):
    pass


Command = Union[Stats, FlushCache, Drain, Resume, Cancel, Trace, SetLogLevel, RecordStart,
                RecordStop]
COMMANDS: tuple[str, ...] = tuple(c.__struct_config__.tag for c in Command.__args__)


# -- replies ------------------------------------------------------------------------------
class _Reply(msgspec.Struct, tag_field="reply", kw_only=True):
    ok: bool = True


class DrainProgress(msgspec.Struct, kw_only=True):
    draining: bool
    in_flight: int                      # HTTP requests still running
    elapsed_seconds: float | None       # since the drain began
    timeout_seconds: float | None       # None: no deadline
    drained: bool                       # draining and nothing left in flight
    timed_out: bool                     # the deadline passed; the rest ended with an error
    exiting: bool                       # a SIGTERM drain: the process exits when done


class ProcessStats(msgspec.Struct, kw_only=True):
    rss_bytes: int                      # resident memory
    open_fds: int                       # file descriptors
    asyncio_tasks: int                  # tasks alive on the event loop
    threads: int
    connections_open: int = 0           # HTTP connections
    connections_refused: int = 0        # over server.max_connections
    header_timeouts: int = 0            # closed for headers not received in time
    slow_readers_cut: int = 0           # streams cut off by server.write_timeout_seconds
    streams_open: int = 0               # the engine's output streams


class WorkerInfo(msgspec.Struct, kw_only=True):
    """One engine worker process (`workers.count` > 1): its state, the router's account
    and its own prefix-cache hit rate."""
    worker: int
    up: bool
    pid: int | None = None
    restarts: int = 0
    last_exit_code: int | None = None
    draining: bool = False
    in_flight: int = 0
    routed: int = 0
    expected_hit_blocks: int = 0
    kv_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    role: str = "both"                  # disaggregation: "prefill" | "decode" | "both"


class StatsReply(_Reply, tag="stats", kw_only=True):
    """The daemon (`model` ... `drain`, `process`), the engine's own typed stats unchanged
    (`engine`: scheduler, KV pool and prefix cache, router, graphs — the same struct /metrics
    exports), and one entry per engine worker process (empty in-process)."""
    model: str
    ready: bool
    uptime_seconds: float
    log_level: str
    in_flight: int                      # HTTP requests being served
    engine_stalled_seconds: float
    drain: DrainProgress
    engine: EngineStats
    # The process (for leak checks: benchmarks/soak.py) and the HTTP connections.
    process: ProcessStats | None = None
    workers: list[WorkerInfo] = []
    # Disaggregation (workers.prefill > 0): decisions, learned rates and handoffs.
    disaggregation: dict | None = None


class FlushCacheReply(_Reply, tag="flush-cache", kw_only=True):
    freed: int                          # cached blocks dropped


class DrainReply(_Reply, tag="drain", kw_only=True):
    progress: DrainProgress


class ResumeReply(_Reply, tag="resume", kw_only=True):
    was_draining: bool


class CancelReply(_Reply, tag="cancel", kw_only=True):
    request_id: str
    cancelled: list[str]                # the engine request ids aborted


class TraceReply(_Reply, tag="trace", kw_only=True):
    request_id: str
    trace: dict[str, Any]               # the engine's trace (several choices: "choices")


class LogLevelReply(_Reply, tag="log-level", kw_only=True):
    level: str
    previous: str


class RecordReply(_Reply, tag="record", kw_only=True):
    """The capture started or just stopped (record-stop: its final counts)."""
    recording: bool
    path: str
    content: str
    requests: int = 0                   # lines written
    dropped: int = 0                    # requests past max_bytes
    bytes: int = 0
    max_bytes: int = 0
    seconds: float = 0.0


ERROR_CODES = ("bad_request", "unknown_command", "line_too_long", "timeout", "forbidden",
               "refused", "not_found", "unavailable", "internal")


class ErrorReply(_Reply, tag="error", kw_only=True):
    ok: bool = False
    code: str
    error: str


Reply = Union[StatsReply, FlushCacheReply, DrainReply, ResumeReply, CancelReply, TraceReply,
              LogLevelReply, RecordReply, ErrorReply]


class ProtocolError(Exception):
    """A line that is not a valid command; `reply` is what to send back."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.reply = ErrorReply(code=code, error=message)


def decode_command(line: bytes) -> Command:
    """One line (without or with its newline) -> a Command, or ProtocolError."""
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError as e:
        raise ProtocolError("bad_request", f"not JSON: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cmd"), str):
        raise ProtocolError("bad_request", 'a command is a JSON object with a "cmd" string, '
                                           'e.g. {"cmd": "stats"}')
    if raw["cmd"] not in COMMANDS:
        raise ProtocolError("unknown_command", f"unknown command {raw['cmd']!r} (commands: "
                                               f"{', '.join(COMMANDS)})")
    try:
        return msgspec.convert(raw, Command)
    except msgspec.ValidationError as e:
        raise ProtocolError("bad_request", f"{raw['cmd']}: {e}") from None


def encode(msg: Command | Reply) -> bytes:
    """A command or reply as one line, newline included."""
    return msgspec.json.encode(msg) + b"\n"


def decode_reply(line: bytes) -> Reply:
    return msgspec.json.decode(line, type=Reply)
