"""Disaggregated prefill/decode (issue #25) on the default model, one server at a time; every
speed figure is compared with a baseline measured in the same run.

    python benchmarks/disagg.py [--quick] [--parts serve,transfer,faults]

1. serve: two workers (one thread, i.e. one core, each) in four set-ups, one after another:
   "colocated" (2 workers serving whole requests, prefix-aware router = always local),
   "remote" (worker 0 prefills, worker 1 decodes, every prompt handed off),
   "cost" (the same roles, the router choosing local or remote per request) and
   "never" (the same roles, no handoffs: worker 1 alone, for reference). Two workloads:
   - interference: --streams short streams (64-token prompts, --short-output tokens each)
     while a --long-len-token prompt (16 tokens out) arrives every --long-every s;
     short-stream ITL p50/p99/max, long-prompt TTFT p50/p99, output tokens/s;
   - uniform: --uniform-requests requests of 256 -> 64 tokens, 4 in flight (closed loop);
     TTFT p50/p99, ITL p50/p99, output tokens/s.
   The cost choice is checked against the better of colocated and remote on each metric.
2. transfer: the handoff of 1,024 tokens' KV (the default model's blocks) through the
   handoff tier (shared memory) and over loopback TCP (the [kv_transfer] pull), against
   the prefill of the same 1,024 tokens on an idle server.
3. faults: 1 prefill + 2 decode workers, 20 requests (512-token prompts, 16 tokens out):
   an undisturbed run, then the same 20 with the decode worker 1 killed (SIGKILL) while
   they are handed off, then with the prefill worker killed while it prefills: completed
   /20, tokens identical to the undisturbed run, handoff blocks left and KV blocks held
   after the lease + 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from harness import model_name, percentile, start_tokenloom
from interference import _stream
from records import record_run, write_raw

SETUPS = {
    "colocated": [],
    "remote": ["workers.prefill=1", "workers.disaggregation=always"],
    "cost": ["workers.prefill=1", "workers.disaggregation=cost"],
    "never": ["workers.prefill=1", "workers.disaggregation=never"],
    # The SLO chunker's old fixed 64-token floor (issue #25 item 7), colocated, for the
    # long prompts' TTFT the target-following floor costs.
    "colocated_floor64": ["scheduler.min_prefill_chunk=64"],
}


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _tokens(rng, n):
    return [rng.randrange(1000, 20000) for _ in range(n)]


async def _interference(url, model, args, rng) -> dict:
    shorts = [_tokens(rng, 64) for _ in range(args.streams)]
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        t0 = time.perf_counter()
        streams = [asyncio.create_task(_stream(session, url, model, p, args.short_output))
                   for p in shorts]
        longs = []
        await asyncio.sleep(1.0)
        while not all(s.done() for s in streams):
            longs.append(asyncio.create_task(_stream(session, url, model,
                                                     _tokens(rng, args.long_len), 16)))
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*streams)),
                                       args.long_every)
            except asyncio.TimeoutError:
                pass
        short = await asyncio.gather(*streams)
        long = await asyncio.gather(*longs)
        elapsed = time.perf_counter() - t0
    gaps = np.array([g for r in short if "gaps" in r for g in r["gaps"]]) * 1e3
    ttfts = [r["ttft"] for r in long if r.get("ttft") is not None]
    tokens = sum(r.get("tokens", 0) for r in short + long)
    return {"errors": sum("error" in r for r in short + long), "long_prompts": len(long),
            "short_itl_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99),
                             "max": float(gaps.max()) if len(gaps) else None},
            "long_ttft_ms": {"p50": percentile(ttfts, 50, 1e3),
                             "p99": percentile(ttfts, 99, 1e3)},
            "output_tok_s": tokens / elapsed}


async def _uniform(url, model, args, rng) -> dict:
    prompts = [_tokens(rng, 256) for _ in range(args.uniform_requests)]
    timeout = aiohttp.ClientTimeout(total=None)
    results = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        queue = list(prompts)
        t0 = time.perf_counter()

        async def worker():
            while queue:
                results.append(await _stream(session, url, model, queue.pop(), 64))

        await asyncio.gather(*(worker() for _ in range(4)))
        elapsed = time.perf_counter() - t0
    gaps = [g * 1e3 for r in results for g in r.get("gaps", [])]
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    return {"errors": sum("error" in r for r in results),
            "ttft_ms": {"p50": percentile(ttfts, 50, 1e3), "p99": percentile(ttfts, 99, 1e3)},
            "itl_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99)},
            "output_tok_s": sum(r.get("tokens", 0) for r in results) / elapsed}


def serve_part(args) -> dict:
    """Every chosen set-up once per round, --repeats rounds (interleaved, so a slow spell
    of the machine hits every set-up alike); a set-up's figures are the medians over its
    runs, with each run kept under "runs" and the spread (max / min) of each figure."""
    chosen = args.setups.split(",") if args.setups else [k for k in SETUPS
                                                         if k != "colocated_floor64"]
    runs: dict[str, list[dict]] = {}
    for r in range(args.repeats):
        for name, row in _serve_round(args, chosen).items():
            runs.setdefault(name, []).append(row)
            if args.repeats > 1:
                print(f"  round {r + 1}/{args.repeats} done: {name}", flush=True)
    out = {}
    for name, rows in runs.items():
        out[name] = rows[0] if len(rows) == 1 else {**_median_row(rows), "runs": rows,
                                                    "spread": _spread_row(rows)}
    return out


def _leaves(row: dict, prefix=()):
    for k, v in row.items():
        if k in ("runs", "spread", "handoffs", "decisions"):
            continue
        if isinstance(v, dict):
            yield from _leaves(v, (*prefix, k))
        elif isinstance(v, (int, float)) and v is not None:
            yield (*prefix, k), v


def _put(row: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        row = row.setdefault(k, {})
    row[path[-1]] = value


def _median_row(rows: list[dict]) -> dict:
    out: dict = {}
    for path, _ in _leaves(rows[0]):
        vals = [v for v in (_get_path(r, path) for r in rows) if v is not None]
        _put(out, path, float(np.median(vals)) if vals else None)
    for k in ("handoffs", "decisions"):
        if k in rows[-1]:
            out[k] = [r.get(k) for r in rows]
    return out


def _spread_row(rows: list[dict]) -> dict:
    out: dict = {}
    for path, _ in _leaves(rows[0]):
        vals = [v for v in (_get_path(r, path) for r in rows) if v is not None]
        if vals and min(vals) > 0:
            _put(out, path, max(vals) / min(vals))
    return out


def _get_path(row: dict, path: tuple):
    for k in path:
        if not isinstance(row, dict) or k not in row:
            return None
        row = row[k]
    return row


def _serve_round(args, chosen: list[str]) -> dict:
    out = {}
    for name, settings in SETUPS.items():
        if name not in chosen:
            continue
        # The measured set-ups let the SLO chunker follow the ITL target (floor 0); the
        # floor64 one overrides it with the default hard floor.
        server = start_tokenloom(args.model, [*args.set, "scheduler.min_prefill_chunk=0",
                                              *settings], args=["--workers", "2"])
        try:
            model = asyncio.run(model_name(server.url))
            row = {}
            for wl in ("interference", "uniform"):
                fn = _interference if wl == "interference" else _uniform
                row[wl] = asyncio.run(fn(server.url, model, args, random.Random(args.seed)))
            h = _get(server.url + "/health").get("handoffs")
            if h:
                row["handoffs"] = {k: h[k] for k in ("outcomes", "bytes_transferred")}
                row["decisions"] = _router_decisions(server.url)
            out[name] = row
            print(f"{name}: {json.dumps(row)}", flush=True)
        finally:
            server.stop()
    return out


def _router_decisions(url: str) -> dict:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tokenloom:disaggregation_decisions_total{"):
            labels = line[line.index("{") + 1:line.index("}")]
            kv = dict(x.split("=", 1) for x in labels.split(","))
            out[f"{kv['choice'].strip(chr(34))}:{kv['reason'].strip(chr(34))}"] = \
                float(line.rsplit(" ", 1)[1])
    return out


def _verdict(out: dict) -> None:
    """The cost choice against the better of always-local (colocated) and always-remote."""
    if not all(k in out for k in ("colocated", "remote", "cost")):
        return
    checks = {}
    for wl, metrics in (("interference", (("short_itl_ms", "p99", False),
                                          ("short_itl_ms", "max", False),
                                          ("long_ttft_ms", "p50", False),
                                          ("output_tok_s", None, True))),
                        ("uniform", (("ttft_ms", "p50", False), ("ttft_ms", "p99", False),
                                     ("itl_ms", "p99", False), ("output_tok_s", None, True)))):
        for metric, q, higher in metrics:
            def val(setup):
                v = out[setup][wl][metric]
                return v[q] if q else v
            best = max(val("colocated"), val("remote")) if higher else \
                min(val("colocated"), val("remote"))
            ratio = (val("cost") / best) if higher else (best / val("cost"))
            def spread(setup):
                sp = _get_path(out[setup].get("spread", {}),
                               (wl, metric, q) if q else (wl, metric))
                return None if sp is None else round(sp, 2)
            checks[f"{wl}.{metric}{'.' + q if q else ''}"] = {
                "colocated": val("colocated"), "remote": val("remote"), "cost": val("cost"),
                "cost_vs_best": ratio, "within_10pct": ratio >= 0.9,
                "spread": {s: spread(s) for s in ("colocated", "remote", "cost")}}
    out["cost_vs_best"] = checks
    print(f"\n{'metric':<34}{'colocated':>11}{'remote':>11}{'cost':>11}{'cost/best':>11}")
    for k, c in checks.items():
        print(f"{k:<34}{c['colocated']:>11.1f}{c['remote']:>11.1f}{c['cost']:>11.1f}"
              f"{c['cost_vs_best']:>11.2f}   spread (max/min over runs) {c['spread']}")


def transfer_part(args) -> dict:
    """Handoff tier (shared memory) and loopback TCP, 1,024 tokens of the default model."""
    from tokenloom.actors.kv.tiers.handoff import HandoffStore
    from tokenloom.actors.kv.tiers.record import BlockMeta, BlockRecord, KVLayout
    from tokenloom.config.schema import KVTransferConfig
    from tokenloom.daemon.kv_transfer.service import KVTransferService

    server = start_tokenloom(args.model, args.set)
    try:
        info = _get(server.url + "/v1/models")
        model = info["data"][0]["id"]
        ttfts = []
        rng = random.Random(args.seed)

        async def prefill():
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    r = await _stream(s, server.url, model, _tokens(rng, 1024), 1)
                    ttfts.append(r["ttft"])
        asyncio.run(prefill())
        stats = _get(server.url + "/v1/models")
    finally:
        server.stop()
    del stats
    # The default model's KV layout: 30 layers, 3 KV heads of 64, fp32, 16-token blocks.
    layers, heads, dim, bs = 30, 3, 64, 16
    layout = KVLayout("float32", (layers, 2, bs, heads, dim), 4, "bench")
    n_blocks = 1024 // bs
    records = [BlockRecord(BlockMeta(os.urandom(32), None, tuple(range(bs))),
                           np.frombuffer(os.urandom(layout.block_bytes), np.uint8))
               for _ in range(n_blocks)]
    shm = Path(tempfile.mkdtemp(prefix="bench-handoff-", dir="/dev/shm"
                                if Path("/dev/shm").is_dir() else None))
    store = HandoffStore(layout, shm, 1 << 32)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for r in records:
            store.put(r)
        t1 = time.perf_counter()
        for r in records:
            assert store.get(r.meta.block_hash) is not None
        t2 = time.perf_counter()
        for r in records:
            store.discard(r.meta.block_hash)
        rounds.append((t1 - t0, t2 - t1))
    write_s = float(np.median([r[0] for r in rounds]))
    read_s = float(np.median([r[1] for r in rounds]))

    async def tcp() -> list[float]:
        src = KVTransferService(KVTransferConfig(port=0, dir=str(shm.parent)), "127.0.0.1")
        src.dir = shm
        src.ledger.root = shm
        dst = KVTransferService(KVTransferConfig(port=0), "127.0.0.1")
        await src.start()
        times = []
        try:
            hashes = [r.meta.block_hash for r in records]
            for i in range(5):
                for r in records:          # a pull claims the export: its files go
                    store.put(r)
                params = await src.export(f"bench-{i}", hashes)
                t0 = time.perf_counter()
                got = await dst.pull(f"bench-{i}", params)
                times.append(time.perf_counter() - t0)
                assert got == len(hashes), got
                dst.release(f"bench-{i}")
        finally:
            await src.close()
            await dst.close()
        return times
    tcp_s = float(np.median(asyncio.run(tcp())))
    nbytes = n_blocks * layout.block_bytes
    prefill_s = float(np.median(ttfts))
    out = {"tokens": 1024, "bytes": nbytes, "prefill_1k_s": prefill_s,
           "shm_write_s": write_s, "shm_read_s": read_s, "shm_total_s": write_s + read_s,
           "tcp_pull_s": tcp_s,
           "shm_mb_s": nbytes / (write_s + read_s) / 1e6, "tcp_mb_s": nbytes / tcp_s / 1e6,
           "shm_over_prefill": (write_s + read_s) / prefill_s, "tcp_over_prefill":
           (write_s + read_s + tcp_s) / prefill_s}
    print(f"transfer of 1,024 tokens ({nbytes / 1e6:.1f} MB): shared memory "
          f"{(write_s + read_s) * 1e3:.1f} ms ({out['shm_over_prefill']:.3f}x the prefill of "
          f"{prefill_s * 1e3:.0f} ms), loopback TCP pull {tcp_s * 1e3:.1f} ms "
          f"(+ the shared-memory write/read: {out['tcp_over_prefill']:.3f}x)", flush=True)
    return out


def _complete_all(url, model, prompts, max_tokens=16) -> list:
    async def go():
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async def one(p):
                body = {"model": model, "prompt": p, "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.status != 200:
                        return None
                    reply = await r.json()
                    return reply["choices"][0]["text"]
            return await asyncio.gather(*(one(p) for p in prompts))
    return asyncio.run(go())


def fault_part(args) -> dict:
    lease = 5.0
    server = start_tokenloom(args.model, [*args.set, "workers.prefill=1",
                                          "workers.disaggregation=always",
                                          f"workers.handoff_lease_seconds={lease}",
                                          "workers.restart_backoff_seconds=0.5",
                                          "workers.min_remote_prefill_tokens=0"],
                             args=["--workers", "3"])
    out = {}
    try:
        model = asyncio.run(model_name(server.url))
        rng = random.Random(args.seed)
        prompts = [_tokens(rng, args.fault_len) for _ in range(20)]
        want = _complete_all(server.url, model, prompts)
        for victim, name, delay in ((1, "decode_worker_killed", args.kill_after),
                                    (0, "prefill_worker_killed", args.kill_after)):
            pid = _get(server.url + "/health")["workers"][victim]["pid"]

            def kill(pid=pid, delay=delay):
                time.sleep(delay)
                os.kill(pid, signal.SIGKILL)
            import threading
            t = threading.Thread(target=kill)
            t.start()
            got = _complete_all(server.url, model, prompts)
            t.join()
            done = sum(g is not None for g in got)
            same = sum(g is not None and g == w for g, w in zip(got, want))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                h = _get(server.url + "/health")
                if all(w["up"] for w in h["workers"]):
                    break
                time.sleep(0.5)
            time.sleep(lease + 1.0)
            h = _get(server.url + "/health")["handoffs"]
            left = len(list(Path(h["dir"]).glob("*.kvb")))
            text = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
            usage = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                     if x.startswith("vllm:kv_cache_usage_perc{")]
            out[name] = {"completed": done, "of": len(prompts), "identical": same,
                         "handoff_blocks_left": left, "kv_usage_after": usage[0] if usage else None,
                         "outcomes": h["outcomes"]}
            print(f"{name}: {json.dumps(out[name])}", flush=True)
    finally:
        server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="serve,transfer,faults")
    ap.add_argument("--setups", default="", help="comma-separated subset of " + ",".join(SETUPS))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--short-output", type=int, default=160)
    ap.add_argument("--long-len", type=int, default=1500)
    ap.add_argument("--long-every", type=float, default=2.0)
    ap.add_argument("--uniform-requests", type=int, default=24)
    ap.add_argument("--fault-len", type=int, default=512)
    ap.add_argument("--kill-after", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds of the serve set-ups; figures are medians over the rounds")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    if args.quick:
        args.streams, args.short_output, args.long_len = 2, 24, 300
        args.uniform_requests, args.fault_len = 6, 128
    args.set = ["server.log_level=warning", *args.set]
    parts = args.parts.split(",")
    result = {"argv": sys.argv[1:]}
    if "serve" in parts:
        result["serve"] = serve_part(args)
        _verdict(result["serve"])
    if "transfer" in parts:
        result["transfer"] = transfer_part(args)
    if "faults" in parts:
        result["faults"] = fault_part(args)
    write_raw("disagg", result)
    record_run("disagg", summary(result), verdict_table(result), args, smoke=args.quick)


def verdict_table(result: dict) -> dict:
    """The cost choice against the better of colocated and remote (_verdict's table)."""
    checks = result.get("serve", {}).get("cost_vs_best", {})
    return {"columns": ["metric", "colocated", "remote", "cost", "cost / best", "within 10%"],
            "rows": [[k, c["colocated"], c["remote"], c["cost"], c["cost_vs_best"],
                      c["within_10pct"]] for k, c in checks.items()]}


def summary(result: dict) -> dict:
    out = {}
    checks = result.get("serve", {}).get("cost_vs_best")
    if checks:
        out["cost_vs_best_worst"] = min(c["cost_vs_best"] for c in checks.values())
        ok = sum(c["within_10pct"] for c in checks.values())
        out["cost_within_10pct"] = f"{ok}/{len(checks)}"
    t = result.get("transfer")
    if t:
        out["shm_over_prefill"], out["tcp_over_prefill"] = (t["shm_over_prefill"],
                                                            t["tcp_over_prefill"])
    for name, f in (result.get("faults") or {}).items():
        out[name] = f"{f['completed']}/{f['of']} completed, {f['identical']} identical"
    return out


if __name__ == "__main__":
    main()
