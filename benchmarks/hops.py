"""Every actor boundary pays its way: the round-trip cost of each hop, idle and under load.

The engine runs in-process (the offline `LLM`, on its background event loop) on a tiny
random-weight Llama with the default model's vocabulary (serve.py's --tiny model), so
compute is small and the numbers are the actors' own. Every measurement runs as a coroutine
on the engine's own loop (`llm._wait`), as the daemon's HTTP handlers would.

Hops (round trip, from the send to the awakened awaiter):
- event loop floor: a future resolved by `loop.call_soon` (no actor; the loop's own cost);
- one typed control query per actor (actors/messages.py, "control"): router GetRouterStats,
  scheduler GetSchedulerStats, KV manager GetKVStats, runner GetRunnerState (the runner is a
  compute thread: its reply comes back through call_soon_threadsafe);
- the pipeline: GetRouterStats / GetSchedulerStats sent to the *tokenizer*, which forwards
  what it does not know in order (tokenizer -> router [-> scheduler]);
- add: `engine.submit` of a short token-id prompt until the router's acknowledgement (the
  empty RequestOutput) is on the stream queue (tokenizer -> router -> stream registry); and,
  for scale, until the first token;
- scheduler <-> KV manager: each step's KVUpdate -> KVGrant as the scheduler awaits it, and
  the KV manager's own work (`apply`) inside it — both by wrapping the two instances'
  methods for the run, nothing else changed — next to the scheduler's own measure,
  SchedulerStats.timings.kv_round_trip_ms (a mean over its last 256 steps).

"Loaded" = --streams concurrent streams decoding in the background on the same loop
(re-submitted as they finish). Samples are spaced by random 0-2 ms sleeps so that they land
anywhere in a step. Prints one table (p50/p99 in µs) and records it (benchmarks/records.py;
every figure in benchmarks/raw/hops.json).

    python benchmarks/hops.py               # 2,000 samples per hop and phase
    python benchmarks/hops.py --quick       # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import build_tiny_vocab_model, percentile, resolve_dir
from records import record_run, write_raw


def _queries():
    from tokenloom.actors.messages import (
        GetKVStats,
        GetRouterStats,
        GetRunnerState,
        GetSchedulerStats,
    )
    return GetKVStats, GetRouterStats, GetRunnerState, GetSchedulerStats


def hops(engine) -> list[tuple[str, object, type]]:
    GetKVStats, GetRouterStats, GetRunnerState, GetSchedulerStats = _queries()
    return [("router (GetRouterStats)", engine.router, GetRouterStats),
            ("tokenizer -> router", engine.tokenizer_actor, GetRouterStats),
            ("scheduler (GetSchedulerStats)", engine.scheduler, GetSchedulerStats),
            ("tokenizer -> router -> scheduler", engine.tokenizer_actor, GetSchedulerStats),
            ("KV manager (GetKVStats)", engine.kv_manager, GetKVStats),
            ("runner thread (GetRunnerState)", engine.runner, GetRunnerState)]


ROWS = ["event loop floor (call_soon)", *[
    "router (GetRouterStats)", "tokenizer -> router", "scheduler (GetSchedulerStats)",
    "tokenizer -> router -> scheduler", "KV manager (GetKVStats)",
    "runner thread (GetRunnerState)"],
    "add: submit -> router ack", "  submit -> router emits the ack",
    "scheduler <-> KV manager per step", "  KV manager apply()",
    "add: submit -> first token (scale)"]


# -- on the engine loop -------------------------------------------------------------------
async def measure_queries(engine, samples: int, rng: random.Random) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    table = hops(engine)
    out: dict[str, list[float]] = {"event loop floor (call_soon)": []}
    out.update({name: [] for name, _, _ in table})
    for _ in range(samples):
        order = [None, *table]
        rng.shuffle(order)
        for item in order:
            await asyncio.sleep(rng.uniform(0, 0.002))
            if item is None:
                fut = loop.create_future()
                t0 = time.perf_counter_ns()
                loop.call_soon(fut.set_result, None)
                await fut
                out["event loop floor (call_soon)"].append((time.perf_counter_ns() - t0) / 1e3)
                continue
            name, actor, query = item
            t0 = time.perf_counter_ns()
            await engine.ask(actor, query())
            out[name].append((time.perf_counter_ns() - t0) / 1e3)
    return out


async def measure_adds(engine, samples: int, prompt_len: int, rng: random.Random):
    from tokenloom.actors.messages import GenerateRequest
    from tokenloom.actors.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    acks, emitted, firsts = [], [], []
    # When the router hands the acknowledgement to the stream registry (its `emit`, wrapped
    # for the run): the rest of the ack's latency is the loop getting round to the waiter.
    router, emit_times = engine.router, {}
    emit = router.emit

    def timed_emit(out):
        emit_times.setdefault(out.request_id, time.perf_counter_ns())
        emit(out)

    router.emit = timed_emit
    for _ in range(samples):
        await asyncio.sleep(rng.uniform(0, 0.002))
        prompt = [rng.randrange(1000, 20000) for _ in range(prompt_len)]
        req = GenerateRequest(request_id=engine.new_request_id(), sampling_params=params,
                              prompt_token_ids=prompt)
        t0 = time.perf_counter_ns()
        queue = engine.submit(req)
        out = await queue.get()
        acks.append((time.perf_counter_ns() - t0) / 1e3)
        emitted.append((emit_times.pop(req.request_id) - t0) / 1e3)
        if out.new_token_ids or out.finished:
            raise RuntimeError(f"expected the router's acknowledgement first, got {out}")
        while not out.new_token_ids and not out.finished:
            out = await queue.get()
        firsts.append((time.perf_counter_ns() - t0) / 1e3)
        while not out.finished:
            out = await queue.get()
    router.emit = emit
    return acks, emitted, firsts


class Background:
    """`n` streams decoding on the engine loop, each re-submitted when it finishes."""

    def __init__(self, engine, n: int, prompt_len: int, max_tokens: int, seed: int):
        self.engine, self.n = engine, n
        self.prompt_len, self.max_tokens = prompt_len, max_tokens
        self.rng = random.Random(seed)
        self.tokens = 0
        self.stop = None
        self.tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._stream()) for _ in range(self.n)]

    async def _stream(self) -> None:
        from tokenloom.actors.messages import GenerateRequest
        from tokenloom.actors.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        while not self.stop.is_set():
            prompt = [self.rng.randrange(1000, 20000) for _ in range(self.prompt_len)]
            req = GenerateRequest(request_id=self.engine.new_request_id(),
                                  sampling_params=params, prompt_token_ids=prompt)
            async with contextlib.aclosing(self.engine.generate(req)) as outs:
                async for out in outs:
                    self.tokens += len(out.new_token_ids)
                    if self.stop.is_set():
                        break   # aclosing: the generator aborts the request

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


async def wait_running(engine, n: int, timeout: float = 60.0) -> None:
    from tokenloom.actors.messages import GetSchedulerStats

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = await engine.ask(engine.scheduler, GetSchedulerStats())
        if stats.running >= n and stats.waiting == 0:
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{n} streams not running after {timeout}s")


class KVProbe:
    """Times the scheduler's KV round trip (await of `_kv_round_trip`; `_kv_update` in
    builds before one round trip per step, so that both can be compared) and the KV
    manager's `apply`, by wrapping those two methods on the instances for the run."""

    def __init__(self, engine):
        self.rt: list[float] = []
        self.apply: list[float] = []
        sched, kv = engine.scheduler, engine.kv_manager
        name = "_kv_round_trip" if hasattr(sched, "_kv_round_trip") else "_kv_update"
        kv_update, apply = getattr(sched, name), kv.apply

        async def timed_kv_update(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return await kv_update(*a, **k)
            finally:
                self.rt.append((time.perf_counter_ns() - t0) / 1e3)

        def timed_apply(update):
            t0 = time.perf_counter_ns()
            try:
                return apply(update)
            finally:
                self.apply.append((time.perf_counter_ns() - t0) / 1e3)

        setattr(sched, name, timed_kv_update)
        kv.apply = timed_apply

    def take(self) -> tuple[list[float], list[float]]:
        rt, ap = self.rt, self.apply
        self.rt, self.apply = [], []
        return rt, ap


# -- driver ---------------------------------------------------------------------------------
def stats_of(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "mean": None}
    a = np.asarray(xs)
    return {"n": int(len(a)), "p50": percentile(a, 50), "p99": percentile(a, 99),
            "mean": float(a.mean())}


def phase(llm, args, probe: KVProbe, rng: random.Random) -> dict:
    from tokenloom.actors.messages import GetSchedulerStats

    probe.take()
    samples = llm._wait(measure_queries(llm.engine, args.samples, rng))
    kv_rt_q, kv_apply_q = probe.take()   # steps during the queries (loaded: the load's)
    acks, emitted, firsts = llm._wait(measure_adds(llm.engine, args.add_samples,
                                                   args.add_prompt_len, rng))
    kv_rt_a, kv_apply_a = probe.take()
    timings = llm.ask(llm.engine.scheduler, GetSchedulerStats()).timings
    samples["add: submit -> router ack"] = acks
    samples["  submit -> router emits the ack"] = emitted
    samples["add: submit -> first token (scale)"] = firsts
    samples["scheduler <-> KV manager per step"] = kv_rt_q + kv_rt_a
    samples["  KV manager apply()"] = kv_apply_q + kv_apply_a
    return {"hops": {k: stats_of(v) for k, v in samples.items()},
            "scheduler_timings": {f: getattr(timings, f) for f in timings.__struct_fields__}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", default="tiny",
                   help="'tiny' (random 2-layer Llama, default vocabulary), 'default', or a dir")
    p.add_argument("--samples", type=int, default=2000, help="per hop and phase")
    p.add_argument("--add-samples", type=int, default=500)
    p.add_argument("--add-prompt-len", type=int, default=16)
    p.add_argument("--streams", type=int, default=32, help="background streams when loaded")
    p.add_argument("--prompt-len", type=int, default=32, help="background prompts")
    p.add_argument("--max-tokens", type=int, default=512, help="background stream length")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="engine config override, e.g. scheduler.overlap=false")
    p.add_argument("--quick", action="store_true", help="smoke test: few samples")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.samples, args.add_samples = min(args.samples, 50), min(args.add_samples, 20)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(f"warning: load average {load1:.2f} — the machine is not quiet, numbers are noisy")

    from tokenloom import LLM, SamplingParams

    options = {}
    for item in args.set:
        key, _, value = item.partition("=")
        options[key] = json.loads(value) if value[:1] in "0123456789-tf[{" else value
    tmp = None
    model = args.model
    if model == "tiny":
        tmp = tempfile.TemporaryDirectory()
        build_tiny_vocab_model(Path(tmp.name), Path(resolve_dir("default")))
        model = tmp.name
    llm = LLM(model=model, quiet=True, **options)
    rng = random.Random(args.seed)
    result = {"args": vars(args), "load_average_at_start": load1}
    try:
        llm.generate([[rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
                      for _ in range(4)], SamplingParams(max_tokens=8, ignore_eos=True))
        probe = KVProbe(llm.engine)
        stats0 = llm.scheduler_stats()
        result["overlap"] = stats0.overlap
        print(f"idle: {args.samples} samples per hop, {args.add_samples} adds", flush=True)
        result["idle"] = phase(llm, args, probe, rng)
        bg = Background(llm.engine, args.streams, args.prompt_len, args.max_tokens, args.seed)
        llm._wait(bg.start())
        try:
            llm._wait(wait_running(llm.engine, args.streams))
            print(f"loaded: {args.streams} streams decoding in the background", flush=True)
            t0, tok0, steps0 = time.perf_counter(), bg.tokens, llm.scheduler_stats().num_steps
            result["loaded"] = phase(llm, args, probe, rng)
            elapsed = time.perf_counter() - t0
            steps = llm.scheduler_stats().num_steps - steps0
            result["loaded"]["background"] = {
                "streams": args.streams, "tokens_per_s": (bg.tokens - tok0) / elapsed,
                "steps_per_s": steps / elapsed, "seconds": elapsed}
        finally:
            llm._wait(bg.close())
    finally:
        llm.close()
        if tmp is not None:
            tmp.cleanup()
    rows = print_table(result)
    write_raw("hops", result)
    # Headline: the loaded p50 of each actor query over the event loop's own floor.
    loaded = result["loaded"]["hops"]
    floor = loaded["event loop floor (call_soon)"]["p50"]
    summary = {"loaded_floor_p50_us": floor, "loaded_p50_over_floor": {
        re.sub(r"\W+", "_", name.split(" (")[0]): loaded[name]["p50"] / floor
        for name in ROWS[1:7] if loaded.get(name, {}).get("p50") and floor}}
    columns = ["hop", "idle p50 µs", "idle p99 µs", "loaded p50 µs", "loaded p99 µs", "n"]
    record_run("hops", summary, {"columns": columns, "rows": rows}, args, smoke=args.quick)


def print_table(result: dict) -> list[list]:
    """Prints the hop table and the scheduler's timings; returns the hop table's rows."""
    idle, loaded = result["idle"]["hops"], result["loaded"]["hops"]
    bg = result["loaded"]["background"]
    print(f"\nactor hops, round trip in µs (overlap {'on' if result['overlap'] else 'off'}; "
          f"loaded = {bg['streams']} streams decoding, {bg['tokens_per_s']:.0f} tok/s, "
          f"{bg['steps_per_s']:.0f} steps/s)")
    print(f"{'hop':<40}{'idle p50':>10}{'p99':>10}{'loaded p50':>12}{'p99':>10}{'n':>7}")
    f = lambda x: f"{x:>10.1f}" if x is not None else f"{'-':>10}"  # noqa: E731
    rows = []
    for name in ROWS:
        a, b = idle.get(name), loaded.get(name)
        if a is None or b is None:
            continue
        print(f"{name:<40}{f(a['p50'])}{f(a['p99'])}  {f(b['p50'])}{f(b['p99'])}"
              f"{b['n']:>7}")
        rows.append([name.strip(), a["p50"], a["p99"], b["p50"], b["p99"], b["n"]])
    print("\nSchedulerStats.timings (ms, means over the scheduler's last 256 steps):")
    print(f"{'':<10}{'steps':>7}{'batch':>7}{'forward':>9}{'host':>8}{'exposed':>9}"
          f"{'kv rt':>8}   | KV round trip / KV apply, per step, means here (µs)")
    for label in ("idle", "loaded"):
        t = result[label]["scheduler_timings"]
        h = result[label]["hops"]
        rt, ap = h["scheduler <-> KV manager per step"], h["  KV manager apply()"]
        extra = (f"{rt['mean']:.0f} / {ap['mean']:.0f}" if rt["mean"] is not None
                 and ap["mean"] is not None else "-")
        print(f"{label:<10}{t['steps']:>7}{t['batch_size']:>7.1f}{t['forward_ms']:>9.3f}"
              f"{t['host_ms']:>8.3f}{t['exposed_host_ms']:>9.3f}{t['kv_round_trip_ms']:>8.3f}"
              f"   | {extra}")
    return rows


if __name__ == "__main__":
    main()
