"""structlog as JSON lines on stderr, one object per line.

Lines about a request carry `request_id`: the HTTP handler binds it in a context variable
(every line its task logs has it), and the actors pass it explicitly.

The level can change at run time (`set_level`, the admin `log-level` command). Loggers bound
before the change (actors bind theirs at start-up) keep their wrapper class, so filtering is
done by a processor that reads the current level, rather than baked into the class.

Start-up progress (model loaded, KV cache size, graph capture...) is logged on the one
start-up logger (tokenloom.startup_log), whose name is in every event. While a
`startup_sink(fn)` block runs, the text of each such event is also handed to `fn` (the
daemon's systemd STATUS= lines), whatever the log level.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Callable, Iterator

import structlog

from tokenloom.startup_log import STARTUP_LOGGER

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


_current = {"level": "info"}


def _filter_by_level(logger, method_name: str, event_dict):
    if _LEVELS.get(method_name, logging.CRITICAL) < _LEVELS[_current["level"]]:
        raise structlog.DropEvent
    return event_dict


_startup_sinks: list[Callable[[str], object]] = []


def _forward_startup(logger, method_name: str, event_dict):
    if event_dict.get("logger_name") == STARTUP_LOGGER:
        for sink in tuple(_startup_sinks):  # the engine may log from a worker thread
            sink(str(event_dict.get("event", "")))
    return event_dict


@contextlib.contextmanager
def startup_sink(sink: Callable[[str], object]) -> Iterator[None]:
    """Hand the text of every start-up event to `sink` (which must not raise) until the block
    ends. Needs the processors installed by `configure`."""
    _startup_sinks.append(sink)
    try:
        yield
    finally:
        _startup_sinks.remove(sink)


def current_level() -> str:
    return _current["level"]


def set_level(level: str) -> str:
    """Change the level of every logger, including ones bound already; returns the old one."""
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, got {level!r}")
    previous, _current["level"] = _current["level"], level
    logging.getLogger().setLevel(max(_LEVELS[level], logging.INFO))
    return previous


def configure(level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    # Libraries logging through the standard library (aiohttp, transformers) come out as the
    # same JSON lines, with their logger's name.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processor=structlog.processors.JSONRenderer(),
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso", utc=True)]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)
    structlog.configure(
        processors=[
            _forward_startup,  # before the level filter: STATUS= lines at any log level
            _filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )
