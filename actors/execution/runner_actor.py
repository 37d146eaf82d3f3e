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
from tokenloom.actors.execution.model_runner import ModelRunner
from tokenloom.actors.messages import (
    ExecuteBatch,
    ForgetRequests,
    GetGraphStats,
    GetRunnerState,
    GraphStats,
    OffloadKV,
    RunnerState,
    Shutdown,
    StepOutput,
)


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

    def __init__(self, model_runner: ModelRunner, scheduler_inbox: asyncio.Queue,
                 run_ahead: bool | None = None):
        """`scheduler_inbox`: where each step's StepOutput goes."""
        super().__init__()
        self.model_runner = runner = model_runner
        # Launch step N+1 before finishing step N when it is queued in time. Pays on CUDA,
        # where launching only queues kernels; on CPU a launch computes the whole forward,
        # so finishing N first gets its tokens out sooner (False there unless forced, e.g.
        # by tests of the CUDA path's bookkeeping).
        self.run_ahead = runner.device.type == "cuda" if run_ahead is None else run_ahead
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # read by the compute thread
        self.scheduler_inbox = scheduler_inbox
        self._loop: asyncio.AbstractEventLoop | None = None
        # The thread the engine was built on (Engine.build sets it): the loop runs there,
        # so that one OpenMP team does all the work (see actors/execution/compute_thread.py). None:
        # a thread of its own.
        self.compute = None
        # Graph/eager counters for /metrics and admin stats, refreshed by the compute thread
        # (a reference swap: readers on the event loop never wait behind a step).
        self.graph_snapshot: GraphStats = runner.graph_stats()
        # The KV storage and its runtime check, refreshed the same way (the engine sets
        # kv_dtype and bytes per token once).
        self.kv_quant_labels = ("auto", 0, "none")
        self.kv_quant_snapshot = runner.kv_quant_stats(*self.kv_quant_labels)
        self.lora_snapshot = runner.lora_stats()
        self._snapshot_time = 0.0
        # Where pooling requests' PooledOutputs go (the engine's stream registry); they are
        # posted before the step's output, so each reaches its stream before the request's
        # finished output does.
        self.pooled_sink = None

    def send(self, msg: Any) -> None:
        self.inbox.put(msg)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        freeze_startup_objects()
        done = self._loop.create_future()
        if self.compute is not None:
            self.compute.submit(self._thread_main, done)
        else:
            threading.Thread(target=self._thread_main, args=(done,), name="tokenloom-runner",
                             daemon=True).start()
        try:
            await done
        finally:
            thaw_objects()
            if self.compute is not None:
                self.compute.stop()
                await asyncio.to_thread(self.compute.join, 10.0)

    # -- the compute thread --------------------------------------------------------------
    def _thread_main(self, done: asyncio.Future) -> None:
        """Take batches in order. A step is launched, then finished (its tokens brought to
        the host and posted to the scheduler). With `run_ahead` (on CUDA), when the next
        batch is already queued and may go ahead, it is launched *before* the previous one
        is finished: its placeholders read the previous step's tokens on the device, and the
        GPU never waits for the host round trip of the sampled ids."""
        pending = None    # ModelRunner.LaunchedStep not finished yet (only with run_ahead)
        last_end = None   # when the previous step was launched after the one before ended
        try:
            while True:
                msg = self._next(pending)
                if msg is None:                     # nothing queued: finish what runs
                    self._finish(pending)
                    pending = None
                    continue
                match msg:
                    case ExecuteBatch():
                        if pending is not None and not self.model_runner.can_launch_ahead(msg):
                            self._finish(pending)
                            pending = None
                        start = time.perf_counter()
                        idle = 0.0 if last_end is None or pending is not None \
                            else start - last_end
                        launched = self._launch(msg, pending)
                        if pending is not None:
                            self._finish(pending)
                        pending = launched
                        if launched is not None:
                            launched.idle_seconds = idle
                        if not self.run_ahead and pending is not None:
                            self._finish(pending)
                            pending = None
                        last_end = time.perf_counter()
                    case ForgetRequests(request_ids=ids):
                        self.model_runner.forget(ids)   # behind every batch sent before it
                    case OffloadKV(offloads=offloads):
                        self.model_runner.offload(offloads)
                    case GetRunnerState(reply=reply):
                        self._post(resolve, reply, RunnerState(
                            num_tracked=self.model_runner.num_tracked,
                            graphs=self.model_runner.graph_stats()))
                    case GetGraphStats(reply=reply):
                        self._post(resolve, reply, self.model_runner.graph_stats())
                    case Shutdown():
                        if pending is not None:
                            self._finish(pending)
                        return
        finally:
            self._post(resolve, done, None)

    def _next(self, pending):
        """The next message; with a step pending, None as soon as it is done on the device
        and nothing is queued (so its tokens go out without waiting for the next batch)."""
        if pending is None:
            return self.inbox.get()
        while True:
            try:
                return self.inbox.get(timeout=0.0005)
            except queue.Empty:
                if pending.done():
                    return None

    def _launch(self, batch: ExecuteBatch, pending):
        try:
            return self.model_runner.launch(batch, pending)
        except Exception as e:  # the step failed; its requests end with an error (the
            self._fail(batch, e)  # scheduler takes outputs by step number, in any order)
            return None

    def _finish(self, launched) -> None:
        try:
            out = self.model_runner.finish(launched)
        except Exception as e:
            self._fail(launched.batch, e)
            return
        out.idle_seconds = launched.idle_seconds
        # Snapshots before the step's output goes out, so a caller who has the output sees
        # stats at least as new; at most every 0.25 s, except that a KV layer promoted in
        # this step shows at once.
        now = time.perf_counter()
        promoted = self.model_runner.num_promoted_layers()
        if (now - self._snapshot_time > 0.25
                or promoted != self.kv_quant_snapshot.num_promoted_layers):
            self._snapshot_time = now
            self.graph_snapshot = self.model_runner.graph_stats()
            self.kv_quant_snapshot = self.model_runner.kv_quant_stats(*self.kv_quant_labels)
            self.lora_snapshot = self.model_runner.lora_stats()
        if self.pooled_sink is not None:
            for pooled in launched.pooled_outputs:
                self._post(self.pooled_sink, pooled)
        self._post(self.scheduler_inbox.put_nowait, out)

    def _fail(self, batch: ExecuteBatch, e: Exception) -> None:
        self.model_runner.forget_failed(batch)
        self.log.error("step failed", step=batch.step, error=repr(e),
                       traceback=traceback.format_exc())
        self._post(self.scheduler_inbox.put_nowait, StepOutput(
            step=batch.step, sampled=[], compute_seconds=0.0,
            error=f"model step failed: {e!r}"))

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed under us: nobody is listening
            pass
