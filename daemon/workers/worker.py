"""One engine worker process: an Engine, and the loop that serves its two sockets.

Started by the front's supervisor as `python -m tokenloom.daemon.workers.worker` with the
worker's config (JSON) on stdin. Start-up: connect the outgoing socket, build the engine
(a failure is reported as `Failed` and the process exits 1), start its actors, warm up,
subscribe to its KV events, then say `Hello`. From then on:

- Submit: the AddRequest goes straight to the engine's router (the front tokenized and
  validated it), its outputs to one shared queue that a sender task drains into `Outputs`
  envelopes — every output of a burst in one message;
- Abort: to the engine's router, behind its request;
- Control: a typed query (stats, flush, trace, drain), answered by `Reply`;
- Stop, or the front process disappearing (the parent pid changes): shut down and exit.

A draining worker refuses new requests (the front stops routing to it first; this closes
the race with a request already on the wire). The engine stopping on its own (a crash)
ends the process with status 1, and the supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import msgspec
import structlog
import zmq
import zmq.asyncio

from tokenloom.actors.messages import RequestOutput, SubscribeKVEvents
from tokenloom.daemon.workers import wire

log = structlog.get_logger("tokenloom.worker")

REPORT_SECONDS = 0.25


class WorkerServer:
    def __init__(self, engine, index: int, incarnation: int, push: zmq.asyncio.Socket):
        self.engine = engine
        self.index = index
        self.incarnation = incarnation
        self.push = push
        self.outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.kv_events: list = []
        self.draining = False
        self._kv_wakeup = asyncio.Event()

    def _envelope(self, cls, **fields):
        return wire.encode(cls(worker=self.index, incarnation=self.incarnation, **fields))

    async def send(self, cls, **fields) -> None:
        await self.push.send(self._envelope(cls, **fields))

    # -- requests ------------------------------------------------------------------------
    def submit(self, add) -> None:
        rid = add.request_id
        if self.draining:
            self.outputs.put_nowait(RequestOutput(
                request_id=rid, new_token_ids=[], finished=True, finish_reason="abort",
                error="the worker is draining; retry later", error_kind="internal"))
            return
        try:
            self.engine.streams.open(rid, self.outputs)
        except ValueError as e:
            self.outputs.put_nowait(RequestOutput(
                request_id=rid, new_token_ids=[], finished=True, finish_reason="error",
                error=str(e), error_kind="invalid_request"))
            return
        self.engine.router.send(add)

    async def forward_outputs(self) -> None:
        while True:
            batch = [await self.outputs.get()]
            while not self.outputs.empty():
                batch.append(self.outputs.get_nowait())
            await self.send(wire.Outputs, outputs=batch)

    def on_kv_event(self, event) -> None:
        # Runs inside the KV manager's mutation: only buffer (actors/kv/events.py's contract).
        self.kv_events.append(event)
        self._kv_wakeup.set()

    async def forward_kv_events(self) -> None:
        while True:
            await self._kv_wakeup.wait()
            self._kv_wakeup.clear()
            events, self.kv_events = self.kv_events, []
            if events:
                await self.send(wire.KVEvents, events=events)

    async def report(self) -> None:
        """The KV pool for the router, and stall time for the front's /health."""
        while True:
            try:
                kv = await asyncio.wait_for(self.engine.stats(), 5.0)
                free, total, usage = kv.kv.free, kv.kv.num_blocks, kv.kv.usage
                lora = kv.scheduler.lora
                adapters = None if lora is None else [n for n in lora.resident if n]
            except asyncio.TimeoutError:   # a wedged engine still reports its stall
                free, total, usage, adapters = 0, self.engine.info.num_blocks, 1.0, None
            await self.send(wire.Report, free_blocks=free, num_blocks=total, kv_usage=usage,
                            stalled_seconds=self.engine.stalled_seconds(),
                            draining=self.draining, lora_adapters=adapters)
            await asyncio.sleep(REPORT_SECONDS)

    # -- control -------------------------------------------------------------------------
    async def control(self, c: wire.Control) -> None:
        try:
            answer = await self._answer(c)
            await self.send(wire.Reply, id=c.id,
                            payload=msgspec.Raw(msgspec.msgpack.encode(answer)))
        except Exception as e:  # noqa: BLE001 - the front reports it to its caller
            await self.send(wire.Reply, id=c.id, error=f"{type(e).__name__}: {e}")

    async def _answer(self, c: wire.Control):
        engine = self.engine
        match c.query:
            case wire.StatsQuery():
                return await engine.stats()
            case wire.FlushQuery(force=force):
                return await engine.flush_prefix_cache(force)
            case wire.TraceQuery(request_id=rid):
                return await engine.trace(rid)
            case wire.DrainQuery(draining=draining):
                was, self.draining = self.draining, draining
                return was
            case wire.LoRAQuery(name=name, path=None):
                return await engine.unload_lora_adapter(name)
            case wire.LoRAQuery(name=name, path=path):
                known = name in (engine.lora_adapters or {})
                await engine.load_lora_adapter(name, path)
                return known
        raise ValueError(f"unknown control query {c.query!r}")

    async def receive(self, pull: zmq.asyncio.Socket, parent: int) -> None:
        """Until Stop, or until the front is gone (we were re-parented)."""
        tasks: set[asyncio.Task] = set()
        while True:
            if not await pull.poll(1000):
                if os.getppid() != parent:
                    log.error("the front process is gone; exiting")
                    return
                continue
            msg = wire.decode_to_worker(await pull.recv())
            match msg:
                case wire.Submit(request=add):
                    self.submit(add)
                case wire.Abort(abort=abort):
                    self.engine.router.send(abort)
                case wire.Control():
                    task = asyncio.create_task(self.control(msg))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                case wire.Stop():
                    return


async def serve(config, index: int, incarnation: int, in_addr: str, out_addr: str,
                parent: int) -> int:
    from tokenloom.actors.engine import Engine
    from tokenloom.daemon.app import warm_up

    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)
    try:
        engine = await asyncio.get_running_loop().run_in_executor(None, Engine.build, config)
    except Exception as e:  # noqa: BLE001 - reported to the front, which fails start-up
        log.exception("worker start-up failed", worker=index)
        await push.send(wire.encode(wire.Failed(worker=index, incarnation=incarnation,
                                                error=str(e),
                                                bad_config=isinstance(e, ValueError))))
        push.close()
        return 1
    server = WorkerServer(engine, index, incarnation, push)
    engine_task = asyncio.create_task(engine.run(), name="engine")
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(in_addr)
    status = 0
    try:
        await warm_up(engine)
        await engine.ask(engine.kv_manager, SubscribeKVEvents(callback=server.on_kv_event))
        await server.send(wire.Hello, pid=os.getpid(), info=engine.info)
        log.info("worker ready", worker=index, pid=os.getpid(), device=engine.info.device,
                 threads=config.model.num_threads)
        helpers = [asyncio.create_task(c) for c in (server.forward_outputs(),
                                                    server.forward_kv_events(),
                                                    server.report())]
        receive = asyncio.create_task(server.receive(pull, parent))
        done, _ = await asyncio.wait({receive, engine_task}, return_when=asyncio.FIRST_COMPLETED)
        if engine_task in done:
            log.error("the engine stopped on its own", worker=index,
                      error=repr(engine_task.exception()) if not engine_task.cancelled()
                      else "cancelled")
            status = 1
        for task in [*helpers, receive]:
            task.cancel()
    finally:
        engine.shutdown()
        await asyncio.wait({engine_task}, timeout=30)
        pull.close()
        push.close()
        ctx.term()
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tokenloom-worker")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--incarnation", type=int, required=True)
    p.add_argument("--in-addr", required=True)
    p.add_argument("--out-addr", required=True)
    p.add_argument("--parent", type=int, required=True)
    args = p.parse_args(argv)
    from tokenloom.config.schema import EngineConfig
    from tokenloom.daemon import logs

    # The front owns this process's life (Stop, or its own exit): a Ctrl-C or systemd's
    # SIGTERM to the whole group must not kill workers under the front's drain.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    logs.configure(config.server.log_level)
    structlog.contextvars.bind_contextvars(worker=args.index)
    t0 = time.monotonic()
    status = asyncio.run(serve(config, args.index, args.incarnation, args.in_addr,
                               args.out_addr, args.parent))
    log.info("worker exiting", worker=args.index, status=status,
             seconds=round(time.monotonic() - t0, 1))
    return status


if __name__ == "__main__":
    sys.exit(main())
