"""`tokenloom serve`: startup -> serve -> drain -> shutdown, on a uvloop event loop.

1. the app starts (model load, actors, warm-up — see app.engine_ctx), then the TCP site binds;
   a JSON log line `{"event": "listening", "host", "port"}` announces it;
2. SIGTERM or SIGINT starts draining: /ready turns 503, new generation requests get 503, and
   running requests get up to `server.drain_timeout_seconds` to finish;
3. the site closes, remaining handlers are cancelled (their requests aborted), actors stop.
A second signal while draining exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import structlog

from tokenloom.config.schema import EngineConfig
from tokenloom.daemon import app as app_module
from tokenloom.daemon.state import STATE

log = structlog.get_logger("tokenloom.daemon")


async def serve(config: EngineConfig, host: str, port: int) -> None:
    app = app_module.create_app(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second signal: exiting now", signal=signal.Signals(signum).name)
            os._exit(128 + signum)
        log.info("signal: draining", signal=signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    runner, bound = await app_module.start(app, host, port)
    log.info("listening", host=host, port=bound, url=f"http://{host}:{bound}")
    try:
        await stop.wait()
        await drain(app, config.server.drain_timeout_seconds)
    finally:
        await runner.cleanup()
        log.info("stopped")


async def drain(app, timeout: float) -> None:
    state = app[STATE]
    state.draining = True
    deadline = time.monotonic() + timeout
    while state.engine is not None and time.monotonic() < deadline:
        stats = await state.engine.query("router", "stats")
        if stats["in_flight"] == 0:
            return
        await asyncio.sleep(0.05)
    log.warning("drain timeout: cancelling the requests still running")


def run(config: EngineConfig, host: str, port: int) -> int:
    import uvloop

    uvloop.run(serve(config, host, port))
    return 0
