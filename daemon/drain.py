"""Draining: stop admitting, let in-flight requests finish, end the rest past a deadline.

One controller serves both ways in:
- SIGTERM/SIGINT (`lifecycle`): `begin(server.drain_timeout_seconds, exiting=True)`, wait,
  then the process exits; it cannot be resumed.
- the admin `drain` command: the same, without exiting; `resume` admits requests again.

Contract:
- `begin` takes effect at once: `state.draining` is set, so `/ready` and new generation
  requests get 503 (with Retry-After) from that moment.
- A request in flight is never dropped silently: it finishes normally, or, once the deadline
  passes, its stream is ended with an error output — a streaming client gets an error event
  and `[DONE]`, a non-streaming one a 503 JSON error — and the engine aborts it.
- `wait()` returns when nothing is in flight any more (or, after a timeout, once the handlers
  had `grace` seconds to write their error events), or when the drain is resumed.
- A second `begin` keeps the earlier deadline if it is sooner.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from tokenloom.daemon.admin.protocol import DrainProgress

log = structlog.get_logger("tokenloom.daemon")


class DrainController:
    def __init__(self, state, poll_seconds: float = 0.05, grace_seconds: float = 10.0):
        self.state = state                  # ServerState: draining flag, inflight, engine
        self.poll_seconds = poll_seconds
        self.grace_seconds = grace_seconds
        self.started: float | None = None
        self.deadline: float | None = None
        self.timed_out = False
        self.exiting = False
        self._task: asyncio.Task | None = None
        self._done = asyncio.Event()
        self.num_waiting = 0                # callers inside wait() (tests wait on this)
        self._worker_tasks: set[asyncio.Task] = set()

    def begin(self, timeout: float | None, exiting: bool = False,
              reason: str = "admin") -> DrainProgress:
        now = time.monotonic()
        if not self.state.draining or self.started is None:
            self.started, self.deadline, self.timed_out = now, None, False
            self.state.draining = True
            log.info("draining", reason=reason, in_flight=len(self.state.inflight),
                     timeout_seconds=timeout)
            self._tell_workers(True)
        if timeout is not None:
            self.deadline = min(now + timeout, self.deadline or float("inf"))
        self.exiting = self.exiting or exiting
        if self._task is None or self._task.done():
            self._done.clear()
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="drain")
        return self.progress()

    def resume(self) -> bool:
        """Admit requests again; False if there was no drain to undo. Refused (RuntimeError)
        while the process is shutting down."""
        if self.exiting:
            raise RuntimeError("the daemon is shutting down; a SIGTERM drain cannot be resumed")
        if not self.state.draining:
            return False
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.state.draining = False
        self._tell_workers(False)
        self.started = self.deadline = None
        self.timed_out = False
        self._done.set()  # wake `drain --wait` callers: the drain is over
        log.info("resumed: admitting requests")
        self.state.notifier.status("ready: admitting requests")
        return True

    def _tell_workers(self, draining: bool) -> None:
        """With worker processes, every worker drains (refuses requests still on their way
        to it) and resumes with the front (the in-process engine has nothing to do)."""
        if self.state.engine is None:
            return
        task = asyncio.get_running_loop().create_task(self.state.engine.set_draining(draining))
        self._worker_tasks.add(task)
        task.add_done_callback(self._worker_done)

    def _worker_done(self, task: asyncio.Task) -> None:
        self._worker_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("telling the workers to drain/resume failed", error=repr(task.exception()))

    async def wait(self) -> DrainProgress:
        self.num_waiting += 1
        try:
            await self._done.wait()
        finally:
            self.num_waiting -= 1
        return self.progress()

    def progress(self) -> DrainProgress:
        now = time.monotonic()
        in_flight = len(self.state.inflight)
        draining = self.state.draining
        return DrainProgress(
            draining=draining, in_flight=in_flight,
            elapsed_seconds=None if self.started is None else round(now - self.started, 3),
            timeout_seconds=(None if self.deadline is None or self.started is None
                             else round(self.deadline - self.started, 3)),
            drained=draining and in_flight == 0, timed_out=self.timed_out,
            exiting=self.exiting)

    async def _watch(self) -> None:
        last = None
        give_up = None
        while True:
            n = len(self.state.inflight)
            if n != last:
                self.state.notifier.status(f"draining: {n} request(s) in flight")
                last = n
            if n == 0:
                break
            now = time.monotonic()
            if not self.timed_out and self.deadline is not None and now >= self.deadline:
                self._expire(n)
                give_up = now + self.grace_seconds
            if give_up is not None and now >= give_up:
                log.error("drain: request handlers still running after the grace period",
                          in_flight=n, grace_seconds=self.grace_seconds)
                break
            await asyncio.sleep(self.poll_seconds)
        log.info("drained", timed_out=self.timed_out)
        self._done.set()

    def _expire(self, n: int) -> None:
        """End every open engine stream with an error; their handlers report it and close,
        and the engine aborts the requests (freeing their KV blocks)."""
        from tokenloom.actors.messages import ERROR_INTERNAL

        self.timed_out = True
        engine = self.state.engine
        message = "the server is draining and the drain timeout passed; retry elsewhere"
        ended = engine.streams.ids() if engine is not None else []
        for rid in ended:
            engine.streams.fail(rid, message, ERROR_INTERNAL, finish_reason="abort")
            engine.abort(rid)
        log.warning("drain timeout: ending the requests still running with an error",
                    in_flight=n, engine_requests=len(ended))
        self.state.notifier.status(f"draining: timeout passed, ending {n} request(s)")
