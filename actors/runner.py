"""The runner actor: executes batches on one dedicated compute thread.

The event loop never runs model code, so the daemon's HTTP layer stays responsive while a
long prompt is being prefilled. A step that raises ends only the requests in that step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import traceback

from tokenloom.actors.base import Actor, Control, resolve
from tokenloom.actors.messages import ExecuteBatch, Shutdown, StepOutput
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
        self.scheduler_inbox: asyncio.Queue | None = None  # wired by the engine
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tokenloom-runner")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        freeze_startup_objects()
        try:
            while True:
                msg = await self.inbox.get()
                match msg:
                    case ExecuteBatch():
                        try:
                            out = await loop.run_in_executor(self._executor, self.runner.execute, msg)
                        except Exception as e:  # the step failed; its requests end with an error
                            self.log.error("step failed", error=repr(e),
                                           traceback=traceback.format_exc())
                            out = StepOutput(step=msg.step, sampled=[], compute_seconds=0.0,
                                             error=f"model step failed: {e!r}")
                        self.scheduler_inbox.put_nowait(out)
                    case Control(op="num_tracked", reply=reply):
                        resolve(reply, self.runner.num_tracked)
                    case Control(op="graph_stats", reply=reply):
                        # Graph/eager step counts, padding waste, decode batch-size histogram.
                        resolve(reply, self.runner.graph_stats())
                    case Shutdown():
                        return
        finally:
            self._executor.shutdown(wait=False)
            thaw_objects()
