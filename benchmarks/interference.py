"""Long-prompt interference (issue #5): do decode streams keep flowing while long prompts
are prefilled?

Workload: `--streams` short prompts (`--prompt-len` tokens) each stream `--output-len`
tokens, all started at once; meanwhile a `--long-len`-token prompt (generating
`--long-output` tokens) arrives every `--long-every` seconds until the streams end. The same
workload runs against two fresh servers, one after the other: (a) `scheduler.chunking =
"static"` (every iteration may fill max_num_batched_tokens with prefill) and (b) `"slo"`
(prefill chunks sized by the online cost model for the ITL target).

Reported per mode: the short streams' inter-token gaps (p50, p99, p99.9, max, and max/p50,
p99/p50 — p99 alone hides the few gaps that contain a whole long prefill) and the long
prompts' TTFT (p50, max); then (b)/(a) ratios. Targets from the issue: with (b) max gap
<= 5x p50, p99 <= 2x p50, long TTFT p50 <= 1.5x (a)'s. The table is the run's record
(benchmarks/records.py), every figure in benchmarks/raw/interference.json.

    python benchmarks/serve.py --interference                # default model
    python benchmarks/serve.py --interference --tiny         # quick check of the plumbing
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import numpy as np

from harness import model_name, percentile, start_tokenloom
from records import record_run, write_raw


async def _stream(session, url, model, prompt, max_tokens) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                ignore_eos=True, stream=True)
    t0 = time.perf_counter()
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"{r.status} {await r.text()}"}
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                if frame.startswith(b"data: {") and b'"text"' in frame:
                    times.append(time.perf_counter())
    return {"ttft": times[0] - t0 if times else None, "gaps": list(np.diff(times)),
            "tokens": len(times)}


async def _run(url, model, args, rng) -> dict:
    shorts = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
              for _ in range(args.streams)]
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        t0 = time.perf_counter()
        streams = [asyncio.create_task(_stream(session, url, model, p, args.output_len))
                   for p in shorts]
        longs = []
        # First long prompt once the streams are decoding, then one every long_every s.
        await asyncio.sleep(min(args.long_every, 2.0))
        while not all(s.done() for s in streams):
            prompt = [rng.randrange(1000, 20000) for _ in range(args.long_len)]
            longs.append(asyncio.create_task(_stream(session, url, model, prompt,
                                                     args.long_output)))
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.gather(*streams)),
                                       args.long_every)
            except asyncio.TimeoutError:
                pass
        short_results = await asyncio.gather(*streams)
        long_results = await asyncio.gather(*longs)
        elapsed = time.perf_counter() - t0
    errors = [r["error"] for r in short_results + long_results if "error" in r]
    gaps = np.array([g for r in short_results if "gaps" in r for g in r["gaps"]]) * 1000
    ttfts = np.array([r["ttft"] for r in long_results if r.get("ttft") is not None]) * 1000
    pct = percentile
    out = {"elapsed_s": elapsed, "errors": len(errors), "num_gaps": int(len(gaps)),
           "num_long_prompts": len(long_results),
           "itl_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "p99.9": pct(gaps, 99.9),
                      "max": float(gaps.max()) if len(gaps) else None},
           "long_ttft_ms": {"p50": pct(ttfts, 50), "max": float(ttfts.max()) if len(ttfts)
                            else None}}
    if errors:
        out["first_error"] = errors[0]
    itl = out["itl_ms"]
    if itl["p50"]:
        out["max_over_p50"] = itl["max"] / itl["p50"]
        out["p99_over_p50"] = itl["p99"] / itl["p50"]
    return out


def interference_main(args, model: str) -> dict:
    summary = {"workload": {k: getattr(args, k) for k in (
        "streams", "prompt_len", "output_len", "long_len", "long_output", "long_every")}}
    base_set = list(args.set)
    for label in ("static", "slo"):
        args.set = base_set + [f"scheduler.chunking={label}"]
        server = start_tokenloom(model, args.set)
        try:
            name = asyncio.run(model_name(server.url))
            summary[label] = asyncio.run(_run(server.url, name, args, random.Random(args.seed)))
        finally:
            server.stop()
    args.set = base_set
    print(f"\n{'':<24}{'static (a)':>14}{'slo (b)':>14}{'(b)/(a)':>10}")
    a, b = summary["static"], summary["slo"]
    rows = [("short ITL p50 ms", a["itl_ms"]["p50"], b["itl_ms"]["p50"]),
            ("short ITL p99 ms", a["itl_ms"]["p99"], b["itl_ms"]["p99"]),
            ("short ITL p99.9 ms", a["itl_ms"]["p99.9"], b["itl_ms"]["p99.9"]),
            ("short max gap ms", a["itl_ms"]["max"], b["itl_ms"]["max"]),
            ("max gap / p50", a.get("max_over_p50"), b.get("max_over_p50")),
            ("p99 / p50", a.get("p99_over_p50"), b.get("p99_over_p50")),
            ("long TTFT p50 ms", a["long_ttft_ms"]["p50"], b["long_ttft_ms"]["p50"]),
            ("long TTFT max ms", a["long_ttft_ms"]["max"], b["long_ttft_ms"]["max"])]
    table = []
    for label, x, y in rows:
        table.append([label, x, y, y / x if x and y else None])
        ratio = f"{y / x:>10.2f}" if x and y else f"{'-':>10}"
        fx = f"{x:>14.1f}" if x is not None else f"{'-':>14}"
        fy = f"{y:>14.1f}" if y is not None else f"{'-':>14}"
        print(f"{label:<24}{fx}{fy}{ratio}")
    print(f"long prompts: {a['num_long_prompts']} (a), {b['num_long_prompts']} (b); "
          f"errors: {a['errors']} (a), {b['errors']} (b)")
    if a["long_ttft_ms"]["p50"] and b["long_ttft_ms"]["p50"]:
        summary["long_ttft_p50_slo_over_static"] = (b["long_ttft_ms"]["p50"]
                                                    / a["long_ttft_ms"]["p50"])
    write_raw("interference", summary)
    headline = {"slo_max_over_p50": b.get("max_over_p50"),
                "slo_p99_over_p50": b.get("p99_over_p50"),
                "long_ttft_p50_slo_over_static": summary.get("long_ttft_p50_slo_over_static"),
                "errors": a["errors"] + b["errors"]}
    columns = ["figure", "static (a)", "slo (b)", "(b)/(a)"]
    record_run("interference", headline, {"columns": columns, "rows": table}, args)
    return summary
