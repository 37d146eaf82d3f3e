"""`tokenloom serve`: startup -> serve -> drain -> shutdown, on a uvloop event loop.

1. the app starts (model load, actors, warm-up — see app.engine_ctx; STATUS= lines go to
   systemd meanwhile), then the TCP site binds; a JSON log line
   `{"event": "listening", "host", "port"}` announces it and systemd gets READY=1;
2. SIGTERM or SIGINT starts draining (daemon.drain): STOPPING=1, /ready and new generation
   requests get 503 at once, running requests get up to `server.drain_timeout_seconds` to
   finish and are then ended with an error event;
3. the site closes, remaining handlers are cancelled (their requests aborted), actors stop,
   and the process exits 0.
A second signal while draining exits at once. Throughout, WATCHDOG=1 pings go to systemd
(when it asks for them) only while the engine loop is healthy (app.engine_problem).
"""

from __future__ import annotations

import asyncio
import os
import signal

import structlog

from tokenloom.config.schema import EngineConfig
from tokenloom.daemon import app as app_module
from tokenloom.daemon.sdnotify import Notifier
from tokenloom.daemon.state import STATE, ServerState

log = structlog.get_logger("tokenloom.daemon")


async def serve(config: EngineConfig, host: str, port: int,
                notifier: Notifier | None = None) -> None:
    notifier = notifier or Notifier()
    app = app_module.create_app(config, notifier=notifier)
    state = app[STATE]
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("second signal: exiting now", signal=name)
            os._exit(128 + signum)
        log.info("signal: draining", signal=name)
        notifier.stopping(f"draining ({name})")
        state.drain.begin(config.server.drain_timeout_seconds, exiting=True, reason=name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    watchdog = (asyncio.create_task(watchdog_loop(state, notifier), name="watchdog")
                if notifier.watchdog_seconds else None)
    try:
        runner, bound = await app_module.start(app, host, port)
        log.info("listening", host=host, port=bound, url=f"http://{host}:{bound}")
        try:
            if not stop.is_set():
                notifier.ready(f"serving on http://{host}:{bound}")
            await stop.wait()
            progress = await state.drain.wait()
            notifier.status("stopping: closing connections"
                            + (" (drain timeout passed)" if progress.timed_out else ""))
        finally:
            await runner.cleanup()
            log.info("stopped")
    finally:
        if watchdog is not None:
            watchdog.cancel()


async def watchdog_loop(state: ServerState, notifier: Notifier) -> None:
    """WATCHDOG=1 every `notifier.watchdog_seconds` while the engine is healthy. A wedged
    engine (no step while work is queued for server.health_stall_seconds) withholds the
    pings, so systemd restarts the service, not just a service whose event loop is stuck."""
    withheld = False
    while True:
        problem = app_module.engine_problem(state)
        if problem is None:
            notifier.watchdog()
            if withheld:
                log.warning("watchdog pings resumed: the engine is making progress again")
        elif not withheld:
            log.error("withholding watchdog pings", reason=problem)
        withheld = problem is not None
        await asyncio.sleep(notifier.watchdog_seconds)


def run(config: EngineConfig, host: str, port: int) -> int:
    import uvloop

    # Read (and unset, so child processes cannot notify for us) $NOTIFY_SOCKET first.
    uvloop.run(serve(config, host, port, Notifier.from_env(unset=True)))
    return 0
