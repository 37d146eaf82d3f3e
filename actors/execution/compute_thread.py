"""One thread for all of an engine's torch work: loading, start-up measurements, the KV
pool, graph capture, and then every step.

On CPU torch parallelises through OpenMP, and libgomp keeps one team of worker threads per
thread that starts parallel regions. When the model is loaded on one thread (the caller's)
and stepped on another (the runner's), the process holds two teams; with more OpenMP
threads than cores, libgomp stops its workers' busy-waiting, and every parallel operation
of a step pays a thread wake-up. Measured on 2 cores (SmolLM2-135M fp32, batch-1 decode):
15.5 ms per step on the loading thread, 31.8 ms on a second one. So the engine is built on
this thread and the runner actor's loop runs on it afterwards: one OpenMP team.

`call` runs a function here and returns its result (the caller's context variables go
with it, e.g. whether start-up progress is shown); `submit` starts one that occupies the
thread (the runner's loop) without waiting; `stop` ends the thread after that.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import queue
import threading


class ComputeThread:
    def __init__(self, name: str = "tokenloom-runner"):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def call(self, fn, *args, **kwargs):
        """Run fn(*args, **kwargs) on this thread; return its result or raise its error."""
        return self.submit(fn, *args, **kwargs).result()

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((contextvars.copy_context(), fn, args, kwargs, future))
        return future

    def stop(self) -> None:
        """End the thread once the task it runs (if any) returns. Idempotent."""
        self._tasks.put(None)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (after `stop`). A process must not exit while it is
        still tearing down its OpenMP team and thread-local native state: that aborts
        ("terminate called without an active exception")."""
        self._thread.join(timeout)

    def _main(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            context, fn, args, kwargs, future = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(context.run(fn, *args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)
