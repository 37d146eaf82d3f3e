"""One worker slot: the current incarnation of worker i (its process and the socket to it),
and what the front remembers across incarnations (restarts, last exit, last report).

`start()` begins a new incarnation: a fresh PUSH socket at a path of its own (nothing queued
for the previous process can reach this one), the process, then the wait for its Hello —
or for its Failed message or its exit, which raise WorkerStartError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import structlog
import zmq

from tokenloom.actors.messages import WorkerStatus
from tokenloom.config.schema import EngineConfig
from tokenloom.daemon.workers import supervisor, wire

log = structlog.get_logger("tokenloom.workers")

STOP_SECONDS = 20.0      # a stopping (or failed) worker gets this long before SIGKILL


class WorkerStartError(RuntimeError):
    pass


class WorkerConfigError(WorkerStartError, ValueError):
    """A worker refused its configuration (or model): `tokenloom serve` reports it on one
    line and exits 2, like the in-process engine does."""


@dataclasses.dataclass
class WorkerSlot:
    index: int
    config: EngineConfig
    incarnation: int = 0
    proc: asyncio.subprocess.Process | None = None
    sock: zmq.Socket | None = None            # PUSH to the current incarnation
    up: bool = False
    hello: asyncio.Future | None = None       # resolved by the front's receive loop
    restarts: int = 0
    last_exit: int | None = None
    last_exit_time: float | None = None
    started_at: float = 0.0
    report: wire.Report | None = None
    replies: dict[int, asyncio.Future] = dataclasses.field(default_factory=dict)
    role: str = "both"                        # disaggregation: "prefill" | "decode" | "both"

    def status(self) -> WorkerStatus:
        r = self.report
        return WorkerStatus(
            worker=self.index, up=self.up,
            pid=self.proc.pid if self.proc is not None and self.up else None,
            incarnation=self.incarnation, restarts=self.restarts,
            last_exit_code=self.last_exit,
            seconds_since_exit=(None if self.last_exit_time is None
                                else round(time.monotonic() - self.last_exit_time, 3)),
            device=self.config.model.device, threads=self.config.model.num_threads or None,
            kv_usage=r.kv_usage if r is not None and self.up else None,
            draining=r.draining if r is not None and self.up else False, role=self.role)

    async def start(self, ctx: zmq.Context, ipc_dir: Path, out_addr: str) -> None:
        """Start the next incarnation and wait until it serves (or raise)."""
        self.incarnation += 1
        in_addr = f"ipc://{ipc_dir}/in-{self.index}-{self.incarnation}"
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)       # bounded by the admission gates, not here
        sock.bind(in_addr)
        self.sock = sock
        self.hello = asyncio.get_running_loop().create_future()
        self.started_at = time.monotonic()
        self.proc = await supervisor.spawn(self.config, self.index, self.incarnation, in_addr,
                                           out_addr)
        exited = asyncio.ensure_future(self.proc.wait())
        done, _ = await asyncio.wait({self.hello, exited}, return_when=asyncio.FIRST_COMPLETED)
        if self.hello in done and self.hello.exception() is None:
            exited.cancel()
            self.up = True
            log.info("worker up", worker=self.index, pid=self.proc.pid,
                     incarnation=self.incarnation, device=self.config.model.device)
            return
        error = (self.hello.exception() if self.hello.done()
                 else WorkerStartError(f"engine worker {self.index} exited with status "
                                       f"{exited.result()} during start-up"))
        if not exited.done():
            await asyncio.wait({exited}, timeout=STOP_SECONDS)
            if self.proc.returncode is None:
                self.proc.kill()
        self.close_socket()
        raise error

    def send(self, envelope) -> bool:
        """Queue one envelope for the current incarnation (never blocks); False if it
        cannot be sent (no socket: the worker is down)."""
        try:
            self.sock.send(wire.encode(envelope), zmq.NOBLOCK)
            return True
        except (zmq.ZMQError, AttributeError) as e:
            log.warning("send to worker failed", worker=self.index, error=str(e))
            return False

    def close_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
