"""The start-up logger: model loaded, KV cache size, kernels chosen, graphs captured...

Every layer logs start-up progress on this one logger. Its name is in each event as
`logger_name` (structlog's PrintLogger has no name of its own, and `logger=` is reserved), so
the daemon can forward these lines to systemd's STATUS= (daemon.logs.startup_sink) and the
offline LLM can show them while it hides other info lines (actors.llm).
"""

from __future__ import annotations

import structlog

STARTUP_LOGGER = "tokenloom.startup"
startup_log = structlog.get_logger(STARTUP_LOGGER, logger_name=STARTUP_LOGGER)
