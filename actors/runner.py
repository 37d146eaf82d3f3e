"""The runner actor: executes batches on its own compute thread, which is its run loop.

The event loop never runs model code, so the daemon's HTTP layer stays responsive while a
long prompt is being prefilled. The inbox is a thread-safe queue read by the compute thread
itself: when steps overlap, the scheduler queues step N+1 while N runs, and the thread
starts N+1 the moment N ends, without waiting for the event loop to get round to it. Step
outputs go back to the scheduler's inbox through the loop's thread-safe callback.

A step that raises ends only the requests in that step (see ModelRunner.execute).
"""

from __future__ import annotations

import asyncio
import gc
import queue
import threading
import time
import traceback
from typing import Any

from tokenloom.actors.base import Actor, resolve
from tokenloom.actors.messages import (ExecuteBatch, GetGraphStats, GetRunnerState, RunnerState,
                                       Shutdown, StepOutput)
from tokenloom.actors.model_runner import ModelRunner


def freeze_startup_objects() -> None:
    """Move everything alive now (torch, transformers, the model: ~400k objects) out of the
    garbage collector's sight while the engine runs. Otherwise each full collection walks
    them all: a 200-250 ms pause of the event loop and of the compute thread alike, every
    few seconds of serving. Called when the engine starts, after the model is loaded (the
    CUDA graph capture freezes too); undone by `thaw_objects` when it stops, so an engine
    inside a longer-lived process (the offline LLM) leaves that process's garbage
    collectable."""
    gc.collect()
    gc.freeze()


def thaw_objects() -> None:
    gc.unfreeze()


class RunnerActor(Actor):
    name = "runner"

    def __init__(self, runner: ModelRunner):
        super().__init__()
        self.runner = runner
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # read by the compute thread
        self.scheduler_inbox: asyncio.Queue | None = None    # wired by the engine
        self._loop: asyncio.AbstractEventLoop | None = None

    def send(self, msg: Any) -> None:
        self.inbox.put(msg)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        freeze_startup_objects()
        done = self._loop.create_future()
        thread = threading.Thread(target=self._thread_main, args=(done,),
                                  name="tokenloom-runner", daemon=True)
        thread.start()
        try:
            await done
        finally:
            thaw_objects()

    # -- the compute thread --------------------------------------------------------------
    def _thread_main(self, done: asyncio.Future) -> None:
        last_end = None   # when the previous step ended: the gap is host time it waited for
        try:
            while True:
                msg = self.inbox.get()
                match msg:
                    case ExecuteBatch():
                        start = time.perf_counter()
                        out = self._execute(msg)
                        out.idle_seconds = 0.0 if last_end is None else start - last_end
                        last_end = time.perf_counter()
                        self._post(self.scheduler_inbox.put_nowait, out)
                    case GetRunnerState(reply=reply):
                        self._post(resolve, reply, RunnerState(
                            num_tracked=self.runner.num_tracked,
                            graphs=self.runner.graph_stats()))
                    case GetGraphStats(reply=reply):
                        self._post(resolve, reply, self.runner.graph_stats())
                    case Shutdown():
                        return
        finally:
            self._post(resolve, done, None)

    def _execute(self, batch: ExecuteBatch) -> StepOutput:
        try:
            return self.runner.execute(batch)
        except Exception as e:  # the step failed; its requests end with an error
            self.runner.forget_failed(batch)
            self.log.error("step failed", step=batch.step, error=repr(e),
                           traceback=traceback.format_exc())
            return StepOutput(step=batch.step, sampled=[], compute_seconds=0.0,
                              error=f"model step failed: {e!r}")

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed under us: nobody is listening
            pass
