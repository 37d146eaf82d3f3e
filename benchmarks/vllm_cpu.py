"""tokenloom against vLLM's own CPU build, workload for workload, one server at a time.

The table of issue #28, in one run on one machine: each server (tokenloom in one or more
modes, then vLLM CPU from ../shared/peers/install-vllm-cpu.sh with the settings that script
prints) runs the same token-id prompts through

- prefill: --prefill-reps distinct 1,024-token prompts, one at a time, 1 output token:
  TTFT median with its min and max (the spread between requests is reported, not hidden);
- decode: batch-1 ITL p50 at ~1,100 tokens of context (1,024-token prompts, 128 tokens);
- streams: 256 -> 64 closed loop at 1, 4 and 16 streams: output tok/s, ITL p50/p99;
- shared prefix: 4 prefixes of 1,024 tokens, each request a prefix + 32 own tokens -> 32,
  8 streams: requests/s (prefix caching on in both, their defaults);
- interference: 4 short streams (64 -> 256, back to back) while a 2,000-token prompt
  arrives every 4 s: the short streams' output tok/s, ITL p99 and max.

Prints one table with tokenloom/vLLM ratios (> 1 is better for tokenloom on every row:
times are inverted) and records it (benchmarks/records.py; every figure of every round in
benchmarks/raw/vllm_cpu.json).

--rounds N runs every server N times, interleaved (tokenloom, vLLM, tokenloom, vLLM...), so
that a slow stretch of a shared machine falls on both; the table then shows each figure's
median over rounds and its spread (max / min over rounds), and the ratio of the medians.

    python benchmarks/vllm_cpu.py --vllm ~/.cache/tokenloom-peers/vllm
    python benchmarks/vllm_cpu.py --rounds 3          # interleaved; medians and spread
    python benchmarks/vllm_cpu.py --vllm VENV --tokenloom bf16 fp32 q4 --quick
    python benchmarks/vllm_cpu.py --no-vllm --variant static:scheduler.chunking=static

--variant NAME:KEY=VALUE[,KEY=VALUE...] adds a tokenloom server: bf16 with those settings,
run in every round beside the --tokenloom modes (settings compared under the same drift).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import interference  # benchmarks/interference.py
from harness import (
    PEERS,
    VOCAB_HI,
    VOCAB_LO,
    PeerStream,
    model_name,
    percentile,
    resolve_dir,
    run_async,
    run_load,
    start_tokenloom,
    start_vllm_cpu,
    summarise,
)
from records import record_run, write_raw

MODES = {  # tokenloom settings per mode
    "bf16": ["model.dtype=bfloat16"],
    "fp32": ["model.dtype=float32"],
    "q4": ["model.weight_dtype=q4"],
}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """"NAME:KEY=VALUE[,KEY=VALUE...]" -> (NAME, ["KEY=VALUE", ...])."""
    name, sep, rest = text.partition(":")
    settings = [item for item in rest.split(",") if item]
    if not sep or not name or name in MODES or name == "vllm" or not settings \
            or any("=" not in item for item in settings):
        raise argparse.ArgumentTypeError(
            f"--variant must be NAME:KEY=VALUE[,KEY=VALUE...] with a NAME other than "
            f"{', '.join([*MODES, 'vllm'])}, got {text!r}")
    return name, settings


def prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)] for _ in range(n)]


def load(url, name, ps, output_len, concurrency, protocol) -> dict:
    results, elapsed = run_async(run_load(url, name, ps, output_len, concurrency, 0, 0, True,
                                          protocol))
    return summarise(results, elapsed)


async def _interference(url, name, args, rng) -> dict:
    """--short-streams slots streaming short requests back to back for --seconds, a
    --long-len prompt every --long-every s meanwhile (the first once they decode)."""
    import aiohttp

    deadline = time.perf_counter() + args.seconds
    shorts: list[dict] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def slot():
            while time.perf_counter() < deadline:
                p = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(64)]
                shorts.append(await interference._stream(session, url, name, p, 256))

        t0 = time.perf_counter()
        slots = [asyncio.create_task(slot()) for _ in range(args.short_streams)]
        await asyncio.sleep(2.0)
        longs = []
        while time.perf_counter() < deadline:
            p = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.long_len)]
            longs.append(asyncio.create_task(
                interference._stream(session, url, name, p, 16)))
            await asyncio.sleep(args.long_every)
        await asyncio.gather(*slots)
        long_results = await asyncio.gather(*longs)
        elapsed = time.perf_counter() - t0
    ok = [r for r in shorts if "error" not in r]
    gaps = np.array([g for r in ok for g in r["gaps"]]) * 1000
    return {"elapsed_s": elapsed, "short_requests": len(shorts),
            "errors": len(shorts) - len(ok) + sum("error" in r for r in long_results),
            "long_prompts": len(long_results),
            "short_output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "short_itl_ms": {"p50": percentile(gaps, 50), "p99": percentile(gaps, 99),
                             "max": float(gaps.max()) if len(gaps) else None}}


def run_server(server, args, protocol) -> dict:
    """Every workload against one started server (stopped here)."""
    res: dict = {"command": " ".join(server.cmd)}
    url = server.url
    try:
        name = run_async(model_name(url))
        load(url, name, prompts(random.Random(99), 4, 64), 8, 4, protocol)   # warm-up
        # The same prompts for every server: each workload draws from its own seed.
        rng = random.Random(1)
        pre = []
        for p in prompts(rng, args.prefill_reps, 1024):
            s = load(url, name, [p], 1, 1, protocol)
            pre.append(s["ttft_ms"]["p50"])
        res["prefill_1024_ttft_ms"] = {"median": statistics.median(pre), "min": min(pre),
                                       "max": max(pre), "all": pre}
        print(f"  prefill 1,024: TTFT median {statistics.median(pre):.0f} ms "
              f"(min {min(pre):.0f}, max {max(pre):.0f})", flush=True)
        s = load(url, name, prompts(random.Random(2), 2, 1024), 128, 1, protocol)
        res["decode_1100_itl_p50_ms"] = s["itl_ms"]["p50"]
        print(f"  batch-1 decode at ~1,100 ctx: ITL p50 {s['itl_ms']['p50']:.1f} ms", flush=True)
        res["streams"] = {}
        for c in args.levels:
            n = max(4, args.requests_per_slot * c)
            s = load(url, name, prompts(random.Random(10 + c), n, 256), 64, c, protocol)
            res["streams"][c] = s
            print(f"  {c} streams: {s['output_tokens_per_s']:.1f} out tok/s, ITL p50 "
                  f"{s['itl_ms']['p50']:.1f} p99 {s['itl_ms']['p99']:.1f} ms, "
                  f"{s['errors']} errors", flush=True)
        rng = random.Random(3)
        prefixes = prompts(rng, 4, 1024)
        shared = [prefixes[i % 4] + prompts(rng, 1, 32)[0] for i in range(args.shared_requests)]
        s = load(url, name, shared, 32, 8, protocol)
        res["shared_prefix"] = s
        print(f"  shared prefix: {s['requests_per_s']:.2f} req/s, {s['errors']} errors",
              flush=True)
        r = run_async(_interference(url, name, args, random.Random(4)))
        res["interference"] = r
        print(f"  interference: {r['short_output_tokens_per_s']:.1f} short out tok/s, ITL p99 "
              f"{r['short_itl_ms']['p99']:.0f} max {r['short_itl_ms']['max']:.0f} ms, "
              f"{r['long_prompts']} long prompts, {r['errors']} errors", flush=True)
    finally:
        server.stop()
    return res


ROWS = [  # label, getter, higher is better
    ("prefill 1,024 TTFT median (ms)", lambda r: r["prefill_1024_ttft_ms"]["median"], False),
    ("batch-1 ITL p50 ~1,100 ctx (ms)", lambda r: r["decode_1100_itl_p50_ms"], False),
]


def rows(levels) -> list:
    out = list(ROWS)
    for c in levels:
        out.append((f"{c} stream(s): out tok/s", lambda r, c=c: r["streams"][c]
                    ["output_tokens_per_s"], True))
        out.append((f"{c} stream(s): ITL p99 (ms)", lambda r, c=c: r["streams"][c]["itl_ms"]
                    ["p99"], False))
    return out + [
        ("shared prefix, 8 streams (req/s)", lambda r: r["shared_prefix"]["requests_per_s"],
         True),
        ("interference: short out tok/s", lambda r: r["interference"]
         ["short_output_tokens_per_s"], True),
        ("interference: short ITL p99 (ms)", lambda r: r["interference"]["short_itl_ms"]["p99"],
         False),
        ("interference: short ITL max (ms)", lambda r: r["interference"]["short_itl_ms"]["max"],
         False),
    ]


def figure(rounds: list[dict], server: str, get) -> tuple[float | None, float | None]:
    """(median over rounds, max / min over rounds) of one figure of one server."""
    vals = []
    for r in rounds:
        try:
            v = get(r[server])
        except (KeyError, TypeError):
            continue
        if v is not None:
            vals.append(v)
    if not vals:
        return None, None
    return statistics.median(vals), (max(vals) / min(vals) if min(vals) > 0 else None)


def table(out: dict, levels) -> tuple[list[str], list[list]]:
    """Per workload row: each server's figure (median over rounds), with more than one round
    each one's spread, and with vLLM each tokenloom server's ratio to it (> 1 is better for
    tokenloom: times are inverted)."""
    rounds = out["rounds"]
    servers = list(dict.fromkeys(s for r in rounds for s in r))
    ours = [s for s in servers if s != "vllm"] if "vllm" in servers else []
    many = len(rounds) > 1
    columns = (["workload", *servers] + ([f"{s} spread" for s in servers] if many else [])
               + [f"{s}/vLLM" for s in ours])
    out_rows = []
    for label, get, higher in rows(levels):
        vals, spreads = {}, {}
        for s in servers:
            vals[s], spreads[s] = figure(rounds, s, get)
        row = [label, *vals.values(), *(spreads.values() if many else ())]
        for s in ours:
            a, b = vals[s], vals["vllm"]
            row.append(None if not a or not b else (a / b if higher else b / a))
        out_rows.append(row)
    return columns, out_rows


def print_table(out: dict, levels) -> None:
    columns, table_rows = table(out, levels)
    n = len(dict.fromkeys(s for r in out["rounds"] for s in r))   # servers
    many = len(out["rounds"]) > 1
    print(f"\n{'workload':<36}" + "".join(f"{c:>14}" for c in columns[1:]))
    for label, *cells in table_rows:
        line = f"{label:<36}" + "".join(f"{v:>14.1f}" if v is not None else f"{'-':>14}"
                                        for v in cells[:n])
        line += "".join(f"{v:>13.2f}x" if v is not None else f"{'-':>14}" for v in cells[n:])
        print(line)
    print("(ratios: > 1 is better for tokenloom; for times, vLLM's over tokenloom's"
          + (f"; medians over {len(out['rounds'])} interleaved rounds, spread = max / min)"
             if many else ")"))


def summary(out: dict, levels) -> dict:
    """Each tokenloom server's ratios to vLLM (without vLLM: each server's figures)."""
    columns, table_rows = table(out, levels)
    ratios = [i for i, c in enumerate(columns) if c.endswith("/vLLM")]
    keep = ratios or range(1, len(dict.fromkeys(s for r in out["rounds"] for s in r)) + 1)
    return {columns[i]: {row[0]: row[i] for row in table_rows if row[i] is not None}
            for i in keep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", type=Path, default=PEERS / "vllm", metavar="VENV")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--tokenloom", nargs="*", default=["bf16"], choices=list(MODES),
                    help="modes to run (none: only the --variant servers)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--model", default="default")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="more tokenloom settings (every mode)")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant,
                    metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                    help="one more tokenloom server: bf16 with these settings (repeatable)")
    ap.add_argument("--levels", type=lambda t: [int(x) for x in t.split(",")],
                    default=[1, 4, 16])
    ap.add_argument("--requests-per-slot", type=int, default=3)
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--shared-requests", type=int, default=32)
    ap.add_argument("--short-streams", type=int, default=4)
    ap.add_argument("--long-len", type=int, default=2000)
    ap.add_argument("--long-every", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every server this many times, interleaved (medians, spread)")
    ap.add_argument("--quick", action="store_true", help="smoke test (numbers mean nothing)")
    args = ap.parse_args()
    if args.quick:
        args.levels, args.requests_per_slot, args.prefill_reps = [1, 4], 1, 2
        args.shared_requests, args.seconds, args.long_len = 8, 8.0, 512
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    if not args.no_vllm and not (args.vllm / "bin" / "python").is_file():
        raise SystemExit(f"no vLLM venv at {args.vllm}: run "
                         f"../shared/peers/install-vllm-cpu.sh (or pass --no-vllm)")
    out: dict = {"workloads": {k: v for k, v in vars(args).items() if k != "vllm"},
                 "rounds": []}
    logdir = Path(tempfile.mkdtemp(prefix="vllm_cpu-"))
    for n in range(args.rounds):
        servers: dict = {}
        out["rounds"].append(servers)
        tag = f" (round {n + 1} of {args.rounds})" if args.rounds > 1 else ""
        configs = [(mode, MODES[mode]) for mode in args.tokenloom]
        configs += [(name, [*MODES["bf16"], *settings]) for name, settings in args.variant]
        for mode, settings in configs:
            print(f"\n== tokenloom {mode}{tag}", flush=True)
            server = start_tokenloom(args.model, ["admin.enabled=false", *settings, *args.set],
                                     log_path=logdir / f"tokenloom-{mode}-{n}.log")
            servers[mode] = run_server(server, args, None)
            write_raw("vllm_cpu", out)
        if not args.no_vllm:
            print(f"\n== vLLM CPU {args.vllm_dtype}{tag} (start-up compiles for ~100 s)",
                  flush=True)
            server = start_vllm_cpu(args.vllm, resolve_dir(args.model),
                                    logdir / f"vllm-{n}.log", args.vllm_dtype)
            servers["vllm"] = run_server(server, args, PeerStream)
            write_raw("vllm_cpu", out)
    print_table(out, args.levels)
    print(f"\nserver logs: {logdir}")
    columns, table_rows = table(out, args.levels)
    record_run("vllm_cpu", summary(out, args.levels), {"columns": columns, "rows": table_rows},
               args, smoke=args.quick)


if __name__ == "__main__":
    main()
