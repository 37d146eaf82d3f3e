"""The front's engine when requests run in worker processes: `WorkerPool`.

It is an `EngineClient` (actors/engine_client.py), like the in-process Engine, and shares
its front half (`EngineFront`: request ids, streams, submit / generate / abort), so nothing
above it knows about processes:

    submit -> tokenizer actor (validates, in order) -> WorkerRouterActor (chooses a worker)
           -> Submit on worker i's socket ... Outputs from any worker -> streams

Disaggregated requests (a prefill worker, then a decode worker) go through
handoff_flow.py.

Supervision: each worker slot runs one loop — start an incarnation, wait for its Hello
(start-up) and then for its exit. A worker that exits while the daemon is not stopping is
a crash: the router stops routing to it (WorkerDown), every stream it held ends at once
with an error output (an HTTP client gets an error event and [DONE], never a hang), its
pending control queries fail, and it is restarted after `workers.restart_backoff_seconds`
(doubling while it keeps dying within a minute of starting). `/health` lists each worker's
state and last exit; `/ready` counts the workers up.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import msgspec
import structlog
import zmq
import zmq.asyncio

from tokenloom.actors.engine_client import EngineFront, merge_traces
from tokenloom.actors.front import disaggregation
from tokenloom.actors.front.routing import RouteDecision, RoutingCore
from tokenloom.actors.kv.block_hash import rope_variant
from tokenloom.actors.kv.prefix_cache import FlushResult
from tokenloom.actors.messages import (
    ERROR_INTERNAL,
    AddRequest,
    EngineStats,
    GetRouterStats,
    GetRoutingStats,
    HandoffMeasured,
    RequestFinished,
    RequestOutput,
    RequestStarted,
    Shutdown,
    WorkerDown,
    WorkerKVEvents,
    WorkerReport,
    WorkerStats,
    WorkerStatus,
    WorkerUp,
)
from tokenloom.config.schema import EngineConfig
from tokenloom.daemon.workers import aggregate, supervisor, wire
from tokenloom.daemon.workers.handoff import HandoffLedger, make_dir
from tokenloom.daemon.workers.handoff_flow import HandoffFlow
from tokenloom.daemon.workers.slot import (
    STOP_SECONDS,
    WorkerConfigError,
    WorkerSlot,
    WorkerStartError,
)

log = structlog.get_logger("tokenloom.workers")

TRACE_HISTORY = 4096     # routing decisions kept for traces
QUERY_SECONDS = 10.0     # a control query's answer must come within this
# Tokens after the first over which a request's decode rate is sampled early (a few steps:
# enough to average out one slow step, few enough to be there for a burst's first choices).
EARLY_DECODE_TOKENS = 3


@dataclasses.dataclass
class _Route:
    worker: int
    started: bool = False
    # Disaggregation's decode rate, measured early (see _early_decode_sample): when the
    # first token arrived and how many have arrived since (None: measured or not needed).
    first_token_at: float | None = None
    tokens: int = 0


class WorkerPool(EngineFront):
    """Build with `await WorkerPool.start(config)` (every worker up and warm, or it raises),
    then run `await pool.run()` like an Engine."""

    def __init__(self, config: EngineConfig):
        super().__init__()
        self.config = config
        self._dir = Path(tempfile.mkdtemp(prefix="tokenloom-workers-"))
        self._out_addr = f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context.shadow(self._ctx.underlying)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self._out_addr)
        w = config.workers
        self.handoff_dir = make_dir(w.handoff_dir, w.handoff_bytes) if w.prefill else None
        configs = supervisor.worker_configs(
            config, handoff_dir=str(self.handoff_dir) if self.handoff_dir else None)
        self.slots = [WorkerSlot(i, c, role=supervisor.role(config, i))
                      for i, c in enumerate(configs)]
        # Handoffs in flight and their leases; the flow that drives them is built with the
        # front (it needs the router). Both None without prefill workers.
        self.ledger = (HandoffLedger(self.handoff_dir, config.workers.handoff_lease_seconds)
                       if self.handoff_dir else None)
        self.handoffs: HandoffFlow | None = None
        self._routes: dict[str, _Route] = {}
        self._decisions: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._query_ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        # Set by _build_front from worker 0's Hello:
        self.info = self.tokenizer = self.router = None
        # LoRA adapters a request may name (every worker serves them); None: [lora] off.
        self.lora_adapters: dict[str, str] | None = (
            dict(config.lora.modules) if config.lora.enabled else None)

    # -- start-up ------------------------------------------------------------------------
    @classmethod
    async def start(cls, config: EngineConfig) -> "WorkerPool":
        pool = cls(config)
        pool.loop = asyncio.get_running_loop()
        pool._spawn(pool._receive(), "workers-receive")
        firsts = [asyncio.get_running_loop().create_future() for _ in pool.slots]
        for slot, first in zip(pool.slots, firsts):
            pool._spawn(pool._supervise(slot, first), f"worker-{slot.index}")
        try:
            hellos = await asyncio.wait_for(asyncio.gather(*firsts),
                                            config.workers.start_timeout_seconds)
        except BaseException as e:
            await pool.close()
            if isinstance(e, asyncio.TimeoutError):
                raise WorkerStartError(
                    f"the engine workers did not start within "
                    f"{config.workers.start_timeout_seconds:g} s "
                    f"(workers.start_timeout_seconds)") from None
            raise
        try:
            await asyncio.get_running_loop().run_in_executor(None, pool._build_front,
                                                             hellos[0])
        except BaseException:
            await pool.close()
            raise
        for slot in pool.slots:
            pool.router.send(WorkerUp(worker=slot.index))
        if pool.handoffs is not None:
            pool._spawn(pool.handoffs.keep_leases(), "handoff-leases")
        return pool

    def _build_front(self, hello: wire.Hello) -> None:
        """The front's tokenizer (validation, chat templates, guided checks) and router,
        from what worker 0 measured; heavy imports, so off the loop."""
        from transformers import AutoTokenizer

        from tokenloom.actors.execution.guided import GuidedCompiler
        from tokenloom.actors.front.router_actor import WorkerRouterActor
        from tokenloom.actors.front.tokenizer_actor import TokenizerActor

        self.info = info = hello.info
        self.tokenizer = AutoTokenizer.from_pretrained(info.model_dir)
        guided = GuidedCompiler(self.tokenizer, info.spec.vocab_size, info.eos_token_ids)
        w = self.config.workers
        core = RoutingCore(len(self.slots), w.routing, w.decode_weight,
                           w.routed_prefix_ttl_seconds)
        disagg = None
        if w.prefill:
            prior = self.config.kv_tiers.recompute_prior_ms_per_token / 1e3
            disagg = disaggregation.Settings(
                mode=w.disaggregation, prefill_workers=list(range(w.prefill)),
                decode_workers=list(range(w.prefill, len(self.slots))),
                min_remote_tokens=w.min_remote_prefill_tokens,
                kv_bytes_per_token=info.kv_bytes_per_token,
                rates=disaggregation.Rates([prior] * len(self.slots),
                                           w.handoff_prior_mb_s * 1e6))
        self.router = WorkerRouterActor(core, self._send_to_worker, self.streams.emit,
                                        info.fingerprint, info.block_size,
                                        self.config.cache.enable_prefix_caching,
                                        disagg=disagg,
                                        variant=partial(rope_variant, info.spec))
        self.tokenizer_actor = TokenizerActor(
            self.tokenizer, info.max_model_len, self.streams.emit, self.router.inbox,
            guided=guided,
            max_prompt_logprobs_tokens=self.config.scheduler.max_prompt_logprobs_tokens)
        if self.ledger is not None:
            self.handoffs = HandoffFlow(self.ledger, self.slots, self.router, self.streams,
                                        self._submit, self._spawn, info.kv_bytes_per_token)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- supervision ---------------------------------------------------------------------
    async def _supervise(self, slot: WorkerSlot, first: asyncio.Future) -> None:
        try:
            await self._supervise_loop(slot, first)
        except asyncio.CancelledError:
            raise
        except BaseException as e:   # a bug here must not silently end supervision
            log.exception("worker supervision failed", worker=slot.index, error=repr(e))
            if not first.done():
                first.set_exception(e)
            raise

    async def _supervise_loop(self, slot: WorkerSlot, first: asyncio.Future) -> None:
        backoff = self.config.workers.restart_backoff_seconds
        while not self._stopping.is_set():
            try:
                await slot.start(self._sync_ctx, self._dir, self._out_addr)
            except WorkerStartError as e:
                if not first.done():
                    first.set_exception(e)
                    return
                log.error("worker restart failed", worker=slot.index, error=str(e))
            else:
                if not first.done():
                    first.set_result(slot.hello.result())
                else:
                    await self._restore_adapters(slot.index)
                    self.router.send(WorkerUp(worker=slot.index))
                    log.warning("worker restarted", worker=slot.index, pid=slot.proc.pid,
                                incarnation=slot.incarnation)
                code = await slot.proc.wait()
                if self._stopping.is_set():
                    return
                self._worker_died(slot, code)
            if time.monotonic() - slot.started_at > 60:
                backoff = self.config.workers.restart_backoff_seconds
            try:
                await asyncio.wait_for(self._stopping.wait(), backoff)
                return
            except asyncio.TimeoutError:
                pass
            backoff = min(max(backoff * 2, 0.5), 30.0)
            slot.restarts += 1

    def _worker_died(self, slot: WorkerSlot, code: int) -> None:
        slot.up = False
        slot.last_exit, slot.last_exit_time = code, time.monotonic()
        self.router.send(WorkerDown(worker=slot.index))
        slot.close_socket()
        lost = [rid for rid, r in self._routes.items() if r.worker == slot.index]
        message = (f"engine worker {slot.index} died (exit status {code}) while serving this "
                   f"request; it is being restarted, retry")
        rehomed = ended = 0
        for rid in lost:
            route = self._routes.pop(rid)
            if self.handoffs is not None and self.handoffs.rehome(rid, route.started,
                                                                  slot.index):
                rehomed += 1
                continue
            self.streams.fail(rid, message, ERROR_INTERNAL)
            ended += 1
        if self.handoffs is not None:   # prefill halves: their decode workers take over
            rehomed += self.handoffs.worker_died(slot.index)
        for reply in slot.replies.values():
            if not reply.done():
                reply.set_exception(RuntimeError(message))
        slot.replies.clear()
        log.error("worker died", worker=slot.index, exit_status=code,
                  requests_ended=ended, requests_rehomed=rehomed,
                  pid=slot.proc.pid if slot.proc else None)

    # -- the transport -------------------------------------------------------------------
    def _send_to_worker(self, w: int, msg, decision: RouteDecision | None) -> None:
        """The router's way out: a request (with the decision) or an abort to worker w."""
        slot = self.slots[w]
        if isinstance(msg, AddRequest):
            rid = msg.request_id
            self._decisions[rid] = decision.as_dict()
            if len(self._decisions) > TRACE_HISTORY:
                self._decisions.popitem(last=False)
            if decision.prefill_worker is not None:
                self.handoffs.start(msg, decision)
                return
            self._submit(w, msg)
        elif self.handoffs is not None and self.handoffs.abortable(msg.request_id):
            self.handoffs.abort(msg.request_id)
        elif slot.up:
            slot.send(wire.Abort(abort=msg))

    def _submit(self, w: int, msg: AddRequest) -> None:
        slot = self.slots[w]
        rid = msg.request_id
        if not slot.up or not slot.send(wire.Submit(request=msg)):
            # Died between the router's choice and now: the request never ran.
            self.streams.fail(rid, f"engine worker {w} is restarting; retry", ERROR_INTERNAL)
            self.router.send(RequestFinished(request_id=rid))
            if self.ledger is not None:
                self.ledger.close(rid, "failed")
            return
        self._routes[rid] = _Route(w)
        if self.ledger is not None and (h := self.ledger.get(rid)) is not None:
            h.decode_worker = w          # (a re-homed one: its new decode worker)

    async def _receive(self) -> None:
        while True:
            try:
                msg = wire.decode_from_worker(await self._pull.recv())
            except zmq.ZMQError:
                return   # closed
            slot = self.slots[msg.worker]
            if msg.incarnation != slot.incarnation:
                continue   # left in flight by a dead incarnation
            match msg:
                case wire.Outputs(outputs=outputs):
                    for out in outputs:
                        self._output(out)
                case wire.KVEvents(events=events) if self.router is not None:
                    self.router.send(WorkerKVEvents(worker=msg.worker, events=events))
                case wire.Report():
                    slot.report = msg
                    if self.router is not None:
                        self.router.send(WorkerReport(worker=msg.worker,
                                                      free_blocks=msg.free_blocks,
                                                      kv_usage=msg.kv_usage,
                                                      lora_adapters=msg.lora_adapters))
                case wire.Reply(id=qid):
                    reply = slot.replies.pop(qid, None)
                    if reply is not None and not reply.done():
                        if msg.error is not None:
                            reply.set_exception(RuntimeError(f"worker {slot.index}: {msg.error}"))
                        else:
                            reply.set_result(msg.payload)
                case wire.Hello():
                    if slot.hello is not None and not slot.hello.done():
                        slot.hello.set_result(msg)
                case wire.Failed(error=error, bad_config=bad_config):
                    if slot.hello is not None and not slot.hello.done():
                        cls = WorkerConfigError if bad_config else WorkerStartError
                        slot.hello.set_exception(cls(
                            f"engine worker {msg.worker} failed to start: {error}"))

    def _output(self, out: RequestOutput) -> None:
        rid = out.request_id
        if self.handoffs is not None and disaggregation.decode_id(rid) is not None:
            self.handoffs.prefill_output(out)   # a prefill half: nothing reaches the client
            return
        route = self._routes.get(rid)
        if route is not None:
            if not route.started and out.new_token_ids:
                route.started = True
                self.router.send(RequestStarted(request_id=rid))
                if self.handoffs is not None:
                    route.first_token_at = time.monotonic()
                    route.tokens = len(out.new_token_ids)
                    if rid in self.ledger:
                        self.ledger.close(rid, "claimed")   # its restore is over
            elif route.first_token_at is not None and out.new_token_ids:
                self._early_decode_sample(route, len(out.new_token_ids))
            if out.finished:
                del self._routes[rid]
                self.router.send(RequestFinished(request_id=rid))
                if self.handoffs is not None:
                    self.ledger.close(rid, "failed" if out.error else "claimed")
                    self.handoffs.measure(route.worker, out)
                trace = out.timings.trace if out.timings is not None else None
                if trace is not None:
                    trace["routing"] = self._decisions.get(rid)
        self.streams.emit(out)

    def _early_decode_sample(self, route: _Route, new_tokens: int) -> None:
        """The cost model's decode rate, from a request's first EARLY_DECODE_TOKENS tokens
        (once per request): a finished request would measure it only after its whole
        output, while the first long prompts of a burst already need it."""
        route.tokens += new_tokens
        if route.tokens > EARLY_DECODE_TOKENS:
            self.router.send(HandoffMeasured(
                worker=route.worker, decode_tokens=route.tokens - 1,
                decode_seconds=time.monotonic() - route.first_token_at))
            route.first_token_at = None

    # -- control queries -----------------------------------------------------------------
    async def ask_worker(self, w: int, query: wire.WorkerQuery):
        """One control query to worker w; its answer decoded as the query's reply type."""
        slot = self.slots[w]
        if not slot.up:
            raise RuntimeError(f"engine worker {w} is not up")
        qid = next(self._query_ids)
        reply = asyncio.get_running_loop().create_future()
        slot.replies[qid] = reply
        if not slot.send(wire.Control(id=qid, query=query)):
            slot.replies.pop(qid, None)
            raise RuntimeError(f"engine worker {w} is not reachable")
        try:   # a wedged worker must not hang admin or /metrics (it still shows in /health)
            raw = await asyncio.wait_for(reply, QUERY_SECONDS)
        finally:
            slot.replies.pop(qid, None)
        kind = query.reply_type
        return msgspec.msgpack.decode(raw, type=kind) if kind else msgspec.msgpack.decode(raw)

    async def ask_all(self, query: wire.WorkerQuery) -> list:
        """The same query to every worker up, answers in worker order."""
        up = [s.index for s in self.slots if s.up]
        return list(await asyncio.gather(*(self.ask_worker(w, query) for w in up)))

    async def stats(self) -> EngineStats:
        per_worker = await self.ask_all(wire.StatsQuery())
        router = await self._ask_router(GetRouterStats())
        if not per_worker:
            raise RuntimeError("no engine worker is up")
        return aggregate.engine_stats(per_worker, router)

    async def worker_stats(self) -> WorkerStats:
        """Per worker: status, the router's account, and each live worker's stats."""
        up = [s.index for s in self.slots if s.up]
        stats = await asyncio.gather(*(self.ask_worker(w, wire.StatsQuery()) for w in up),
                                     return_exceptions=True)
        routing = await self._ask_router(GetRoutingStats())
        if routing.disaggregation is not None:
            routing.disaggregation["handoffs"] = self.handoff_status()
        return WorkerStats(statuses=self.worker_status(),
                           routing=routing,
                           engines={w: s for w, s in zip(up, stats)
                                    if isinstance(s, EngineStats)})

    async def flush_prefix_cache(self, force: bool = False) -> FlushResult:
        results = await self.ask_all(wire.FlushQuery(force=force))
        refused = [f"worker {i}: {r.refused_reason}" for i, r in enumerate(results)
                   if r.refused_reason]
        return FlushResult(freed=sum(r.freed for r in results),
                           refused_reason="; ".join(refused) or None)

    async def set_draining(self, draining: bool) -> None:
        """Drain (or resume) every worker up; the front has stopped routing already."""
        await self.ask_all(wire.DrainQuery(draining=draining))

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Checked here first (a LoRAAdapterError naming it), then served by every worker."""
        from tokenloom.kernels.lora.peft_adapter import LoRAAdapterError, load_adapter
        if self.lora_adapters is None:
            raise LoRAAdapterError("LoRA serving is off (lora.enable)")
        await asyncio.to_thread(load_adapter, name, path, self.info.spec,
                                self.config.lora.max_lora_rank)
        await self.ask_all(wire.LoRAQuery(name=name, path=str(path)))
        self.lora_adapters[name] = str(path)

    async def unload_lora_adapter(self, name: str) -> bool:
        if self.lora_adapters is None or self.lora_adapters.pop(name, None) is None:
            return False
        await self.ask_all(wire.LoRAQuery(name=name))
        return True

    async def _restore_adapters(self, w: int) -> None:
        """A restarted worker serves the adapters loaded at run time before it takes
        requests again (the start-up ones come with its config)."""
        started = self.config.lora.modules
        for name, path in (self.lora_adapters or {}).items():
            if started.get(name) == path:
                continue
            try:
                await self.ask_worker(w, wire.LoRAQuery(name=name, path=path))
            except Exception as e:  # noqa: BLE001 - its requests fail by name instead
                log.error("restarted worker could not load a LoRA adapter", worker=w,
                          adapter=name, error=str(e))

    async def trace(self, request_id: str) -> dict | None:
        """A recent request's trace from the worker that ran it, with the routing decision
        (`routing`: worker, policy, reason, prompt and expected hit blocks, costs)."""
        traces = []   # the choices of one HTTP request may have run on several workers
        for t in await self.ask_all(wire.TraceQuery(request_id=request_id)):
            if t is not None:
                traces += t.get("choices", [t])
        for t in traces:
            t["routing"] = self._decisions.get(t.get("request_id"))
        return merge_traces(request_id, traces)

    async def _ask_router(self, query):
        query.reply = asyncio.get_running_loop().create_future()
        self.router.send(query)
        return await query.reply

    def stalled_seconds(self) -> float:
        return max((s.report.stalled_seconds for s in self.slots if s.up and s.report),
                   default=0.0)

    def worker_status(self) -> list[WorkerStatus]:
        return [s.status() for s in self.slots]

    def handoff_status(self) -> dict | None:
        """Disaggregation's handoffs (in flight, leases, outcomes, bytes) for /health,
        admin stats and /metrics; None without prefill workers."""
        return self.ledger.stats() if self.ledger is not None else None

    def degraded_tiers(self) -> dict[str, str]:
        return {}   # (each worker's tiers show in its stats: admin stats, /metrics)

    # -- running -------------------------------------------------------------------------
    async def run(self) -> None:
        """The front's actors until shutdown; then the workers are stopped."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.tokenizer_actor.run(), name="tokenizer")
                tg.create_task(self.router.run(), name="router")
        finally:
            await self.close()

    def shutdown(self) -> None:
        self.tokenizer_actor.send(Shutdown())
        self.router.send(Shutdown())

    async def close(self) -> None:
        """Stop every worker (Stop, then SIGKILL after STOP_SECONDS) and the transport."""
        self._stopping.set()
        procs = []
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                if slot.up:
                    slot.send(wire.Stop())
                else:              # still starting (it reads no socket yet): nothing to lose
                    slot.proc.kill()
                procs.append(slot.proc)
        if procs:
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs],
                                            timeout=STOP_SECONDS)
            for p in procs:
                if p.returncode is None:
                    p.kill()
            if pending:
                await asyncio.wait(pending, timeout=5)
        for slot in self.slots:
            slot.up = False
            slot.close_socket()
        for task in list(self._tasks):
            task.cancel()
        self._pull.close(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
        if self.handoff_dir is not None:
            shutil.rmtree(self.handoff_dir, ignore_errors=True)

