"""The engine loop (overlapped scheduling) benchmark: does the device ever wait for Python?

One script, one server at a time (never two at once), the load generator of serve.py, every
number next to its baseline from the same run, reported as ratios. Sections (all by default;
pick some with `--section a --section c ...`):

 (a) tiny random-weight model (serve.py --tiny), 64 concurrent streams, 32-token prompts,
     64 new tokens: tokenloom with `scheduler.overlap` on vs off — output tok/s, ITL p50 and
     the on/off ratio (target: >= 2x tok/s).
 (b) default model, 256-token prompts, 64 new tokens, closed loop at concurrency 1, 4, 16
     (max(4, 3 x concurrency) requests per level): tokenloom overlap on, overlap off and
     llama.cpp's llama-server (F32 GGUF of the same model, -t 2, -np = concurrency), with the
     same token-id prompts: output tok/s, ITL p50/p99, TTFT p50, and tokenloom/llama.cpp
     ratios (targets: tok/s >= 1.0x, ITL p50 <= 1.0x).
 (c) host time per step outside the forward pass at batch 1 and 16 (default model), from the
     server's /metrics `tokenloom:step_time_ms` (means over the last 256 steps): after each of
     those levels of (b) the same server runs `concurrency` streams of --host-steps tokens, so
     that the whole window is steady decode at that batch size, then /metrics is read.
     exposed_host / (forward + exposed_host), overlap on and off (target: < 10% with overlap).
     (Without (b), (c) runs the tokenloom part of (b) at its two levels itself.)
 (d) long-prompt interference (benchmarks/interference.py's workload: --streams short
     streams, a --long-len-token prompt every --long-every s) on the default model with
     overlap on, for --interference-seconds, once without and once with the long prompts:
     short-stream ITL p50 with/without (target <= 1.5x) and p99/p50 with them (<= 3x).

Then one summary table: every target, the measured value, met or missed; it is the run's
record (benchmarks/records.py), and every figure goes to benchmarks/raw/engine_loop.json
(written after every section). `--quick` shrinks every section to a smoke test (its numbers
mean nothing: its record stays out of benchmarks/results/).

    python benchmarks/engine_loop.py                     # everything, on a quiet machine
    python benchmarks/engine_loop.py --section b --section c
    python benchmarks/engine_loop.py --quick             # end-to-end smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

import interference  # benchmarks/interference.py
from harness import (
    PEERS,
    VOCAB_HI,
    VOCAB_LO,
    PeerStream,
    build_tiny_vocab_model,
    model_name,
    percentile,
    print_table,
    resolve_dir,
    run_async,
    run_load,
    start_llama_server,
    start_tokenloom,
    start_vllm_cpu,
    summarise,
)
from records import record_run, write_raw


# -- servers -----------------------------------------------------------------------------
def serve_tokenloom(model: str, overlap: bool, extra: list[str]):
    """`tokenloom serve` with overlap on or off, admin socket off (others may run one)."""
    settings = [f"scheduler.overlap={'true' if overlap else 'false'}", "admin.enabled=false",
                *extra]
    return start_tokenloom(model, settings)


def start_llama(args, slots: int, ctx: int, logdir: Path):
    """llama-server (the F32 GGUF of --gguf) with `slots` slots sharing a `ctx`-token cache."""
    return start_llama_server(args.llama_server, args.gguf, slots, ctx, args.llama_threads,
                              logdir / "llama-server.log")


def complete(url: str, model: str, prompt, max_tokens: int) -> dict:
    """One non-streaming greedy /v1/completions request (ignore_eos)."""
    body = json.dumps(dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                           ignore_eos=True)).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return {"status": r.status, **json.loads(r.read())}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode(errors="replace")[:500]}


def step_times(url: str) -> dict:
    """`tokenloom:step_time_ms{part=...}` from /metrics: {part: ms}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'^tokenloom:step_time_ms\{[^}]*part="(\w+)"[^}]*\}\s+(\S+)', text,
                         re.M):
        out[m.group(1) + "_ms"] = float(m.group(2))
    return out


def exposed_share(t: dict) -> float | None:
    """exposed host time as a share of a step (forward + exposed host)."""
    if not t or t.get("forward_ms") is None:
        return None
    denom = t["forward_ms"] + t["exposed_host_ms"]
    return t["exposed_host_ms"] / denom if denom > 0 else None


# -- workloads ---------------------------------------------------------------------------
def random_prompts(rng: random.Random, n: int, length: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)] for _ in range(n)]


def load(url: str, name: str, prompts, output_len: int, concurrency: int, seed: int,
         protocol=None) -> dict:
    results, elapsed = run_async(run_load(url, name, prompts, output_len, concurrency, 0, seed,
                                          True, protocol))
    return summarise(results, elapsed)


def warm_up(url: str, name: str, rng: random.Random, concurrency: int, protocol=None) -> None:
    """A few steps at this batch size, on prompts nothing measured uses (no cache hits)."""
    n = max(2, concurrency)
    load(url, name, random_prompts(rng, n, 16), 4, n, 0, protocol)


def level_plan(args) -> list[tuple[int, int]]:
    """(concurrency, requests) per level of (b)."""
    plan = []
    for c in args.levels:
        n = max(2, c) if args.quick else max(4, args.requests_per_slot * c)
        plan.append((c, n))
    return plan


# -- (a) ---------------------------------------------------------------------------------
def section_a(args, out: dict) -> None:
    n = 64 if args.quick else args.tiny_requests
    conc, plen, olen = args.tiny_concurrency, 32, 64
    print(f"\n== (a) tiny model: {conc} streams, {plen}-token prompts, {olen} new tokens, "
          f"{n} requests; overlap on vs off", flush=True)
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, n, plen)
    res = {"workload": {"concurrency": conc, "prompt_len": plen, "output_len": olen,
                        "requests": n}}
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_vocab_model(Path(tmp), Path(resolve_dir("default")))
        for label, overlap in (("overlap_on", True), ("overlap_off", False)):
            server = serve_tokenloom(tmp, overlap, args.set)
            url = server.url
            try:
                name = run_async(model_name(url))
                warm_up(url, name, random.Random(args.seed + 7), conc)
                s = load(url, name, prompts, olen, conc, args.seed)
                s["step_time"] = step_times(url)
            finally:
                server.stop()
            res[label] = s
            print_table(f"tokenloom tiny, {label.replace('_', ' ')}", s)
    on, off = res["overlap_on"], res["overlap_off"]
    res["tok_s_on_over_off"] = _ratio(on["output_tokens_per_s"], off["output_tokens_per_s"])
    res["itl_p50_on_over_off"] = _ratio(on["itl_ms"]["p50"], off["itl_ms"]["p50"])
    print(f"\n{'(a) tiny, 64 streams':<26}{'overlap on':>12}{'overlap off':>12}{'on/off':>9}")
    rows = [("output tok/s", on["output_tokens_per_s"], off["output_tokens_per_s"]),
            ("ITL p50 ms", on["itl_ms"]["p50"], off["itl_ms"]["p50"]),
            ("ITL p99 ms", on["itl_ms"]["p99"], off["itl_ms"]["p99"]),
            ("TTFT p50 ms", on["ttft_ms"]["p50"], off["ttft_ms"]["p50"])]
    for part in ("forward_ms", "host_ms", "exposed_host_ms"):
        rows.append((f"step {part[:-3]} ms", on["step_time"].get(part),
                     off["step_time"].get(part)))
    for label, x, y in rows:
        print(f"{label:<26}{_f(x, 12)}{_f(y, 12)}{_f(_ratio(x, y), 9, 2)}")
    out["a"] = res


# -- (b) and (c) -------------------------------------------------------------------------
def tokenloom_levels(args, overlap: bool, plan, prompts_by_level, host_prompts,
                     check_prompt) -> dict:
    """One tokenloom server (default model) through every level; after the levels named by
    --host-levels, a steady probe at that batch size and a /metrics read."""
    label = "overlap on" if overlap else "overlap off"
    server = serve_tokenloom(args.model, overlap, args.set)
    url = server.url
    res: dict = {"levels": {}, "host": {}}
    try:
        name = run_async(model_name(url))
        res["check"] = complete(url, name, check_prompt, 8)
        for (c, _n), prompts in zip(plan, prompts_by_level):
            warm_up(url, name, random.Random(args.seed + 100 + c), c)
            s = load(url, name, prompts, args.output_len, c, args.seed)
            s["step_time_after_level"] = step_times(url)
            res["levels"][c] = s
            print_table(f"tokenloom {label}, concurrency {c}", s)
            if c in args.host_levels and c in host_prompts:
                probe = load(url, name, host_prompts[c], args.host_steps, c, args.seed)
                t = step_times(url)
                res["host"][c] = {"step_time": t, "exposed_share": exposed_share(t),
                                  "probe_tok_s": probe["output_tokens_per_s"],
                                  "probe_itl_p50_ms": probe["itl_ms"]["p50"],
                                  "probe_errors": probe["errors"]}
                print(f"  steady batch {c} ({args.host_steps} tokens each): {t}", flush=True)
    finally:
        server.stop()
    return res


def llama_levels(args, plan, prompts_by_level, check_prompt, logdir: Path) -> dict:
    res: dict = {"levels": {}, "kind": gguf_kind(args.gguf)}
    for (c, _n), prompts in zip(plan, prompts_by_level):
        slots = max(c, 1)
        ctx = max(slots * args.llama_ctx_per_slot, 1024)
        server = start_llama(args, slots, ctx, logdir)
        url = server.url
        res.setdefault("commands", {})[c] = " ".join(server.cmd)
        try:
            name = run_async(model_name(url))
            if "check" not in res:
                res["check"] = complete(url, name, check_prompt, 8)
            warm_up(url, name, random.Random(args.seed + 100 + c), c, PeerStream)
            s = load(url, name, prompts, args.output_len, c, args.seed, PeerStream)
            res["levels"][c] = s
            print_table(f"llama-server {gguf_kind(args.gguf)}, concurrency {c} "
                        f"(-np {slots} -c {ctx})", s)
        finally:
            server.stop()
    return res


def vllm_levels(args, plan, prompts_by_level, check_prompt, logdir: Path) -> dict:
    """vLLM's CPU build (--vllm: its venv) through every level, one server for all of
    them (its scheduler sizes batches itself), with the same token-id prompts."""
    res: dict = {"levels": {}, "kind": args.vllm_dtype}
    server = start_vllm_cpu(args.vllm, resolve_dir(args.model), logdir / "vllm.log",
                            args.vllm_dtype)
    res["command"] = " ".join(server.cmd)
    try:
        name = run_async(model_name(server.url))
        res["check"] = complete(server.url, name, check_prompt, 8)
        for (c, _n), prompts in zip(plan, prompts_by_level):
            warm_up(server.url, name, random.Random(args.seed + 100 + c), c, PeerStream)
            s = load(server.url, name, prompts, args.output_len, c, args.seed, PeerStream)
            res["levels"][c] = s
            print_table(f"vLLM CPU {args.vllm_dtype}, concurrency {c}", s)
    finally:
        server.stop()
    return res


def token_prompts_ok(args, check_prompt, logdir: Path) -> tuple[bool, dict]:
    """Does llama-server take token-id prompts as they are (no BOS added)?"""
    server = start_llama(args, 1, 1024, logdir)
    url = server.url
    try:
        name = run_async(model_name(url))
        r = complete(url, name, check_prompt, 1)
    finally:
        server.stop()
    n = (r.get("usage") or {}).get("prompt_tokens")
    return r.get("status") == 200 and n == len(check_prompt), {"status": r.get("status"),
                                                                "prompt_tokens": n,
                                                                "sent": len(check_prompt)}


def section_bc(args, out: dict, run_b: bool, run_c: bool) -> None:
    plan = level_plan(args)
    if not run_b:   # (c) alone: only its levels, tokenloom only
        plan = [(c, n) for c, n in plan if c in args.host_levels] or \
               [(c, max(2, c) if args.quick else max(4, args.requests_per_slot * c))
                for c in args.host_levels]
    rng = random.Random(args.seed + 1)
    prompts_by_level = [random_prompts(rng, n, args.prompt_len) for _, n in plan]
    host_prompts = {c: random_prompts(rng, c, args.prompt_len) for c, _ in plan
                    if c in args.host_levels} if run_c else {}
    check_prompt = random_prompts(rng, 1, args.prompt_len)[0]
    levels = ", ".join(f"c={c}: {n} req" for c, n in plan)
    print(f"\n== ({'b' if run_b else ''}{'c' if run_c else ''}) default model: "
          f"{args.prompt_len}-token prompts, {args.output_len} new tokens, closed loop "
          f"({levels})", flush=True)
    res: dict = {"workload": {"prompt_len": args.prompt_len, "output_len": args.output_len,
                              "levels": {c: n for c, n in plan}, "host_steps": args.host_steps},
                 "prompts": "token ids"}
    logdir = Path(tempfile.mkdtemp(prefix="engine_loop-"))
    peer = run_b and not args.no_peer
    if peer and not (args.llama_server.is_file() and os.access(args.llama_server, os.X_OK)):
        print(f"\nllama-server not found at {args.llama_server}: the llama.cpp peer is "
              f"SKIPPED (build it with shared/peers/build-llama-server.sh)")
        res["peer_skipped"] = f"no llama-server at {args.llama_server}"
        peer = False
    elif peer and not args.gguf.is_file():
        print(f"\n{args.gguf} not found: the llama.cpp peer is SKIPPED")
        res["peer_skipped"] = f"no GGUF at {args.gguf}"
        peer = False
    if peer:
        ok, detail = token_prompts_ok(args, check_prompt, logdir)
        res["token_id_prompts"] = detail
        if ok:
            print(f"llama-server takes token-id prompts as sent ({detail})")
        else:
            # Fall back to the same text for every server (decoded with the HF tokenizer).
            print(f"llama-server does not take token-id prompts as sent ({detail}); "
                  f"every server gets text prompts instead")
            prompts_by_level, host_prompts, check_prompt = _as_text(
                args, prompts_by_level, host_prompts, check_prompt)
            res["prompts"] = "text"
        res["llama"] = llama_levels(args, plan, prompts_by_level, check_prompt, logdir)
        res["llama"]["log"] = str(logdir / "llama-server.log")
    for key, overlap in (("on", True), ("off", False)):
        res[key] = tokenloom_levels(args, overlap, plan, prompts_by_level, host_prompts,
                                    check_prompt)
        _write(args, out)
    if run_b and args.vllm is not None:
        res["vllm"] = vllm_levels(args, plan, prompts_by_level, check_prompt, logdir)
        _write(args, out)
    if peer:
        a = res["on"]["check"].get("choices", [{}])[0].get("text")
        b = res["llama"]["check"].get("choices", [{}])[0].get("text")
        res["greedy_8_tokens_match"] = a == b
        print(f"\nsame prompt, 8 greedy tokens: tokenloom {a!r} / llama.cpp {b!r} "
              f"({'identical' if a == b else 'different'})")
    if run_b:
        _print_b(res, plan, peer)
    if run_c:
        _print_c(res, args)
    if run_b:
        out["b"] = {k: v for k, v in res.items()}
    if run_c:
        out["c"] = {"levels": {c: {"on": res["on"]["host"].get(c),
                                   "off": res["off"]["host"].get(c)} for c in args.host_levels}}


def _as_text(args, prompts_by_level, host_prompts, check_prompt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_dir(args.model))
    dec = lambda ids: tok.decode(ids)  # noqa: E731
    return ([[dec(p) for p in ps] for ps in prompts_by_level],
            {c: [dec(p) for p in ps] for c, ps in host_prompts.items()}, dec(check_prompt))


def gguf_kind(path) -> str:
    """The weight type a GGUF's file name states (SmolLM2-135M-Instruct.Q4_1.gguf -> Q4_1)."""
    parts = Path(path).name.split(".")
    return parts[-2] if len(parts) >= 3 else "GGUF"


def _print_b(res: dict, plan, peer: bool) -> None:
    print(f"\n(b) default model{'':<12}{'req':>5}{'tok/s':>9}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'TTFT p50':>10}   (ms)")
    for c, n in plan:
        rows = [("tokenloom overlap on", res["on"]["levels"][c]),
                ("tokenloom overlap off", res["off"]["levels"][c])]
        if peer:
            rows.append((f"llama.cpp {res['llama'].get('kind', 'F32')}",
                         res["llama"]["levels"][c]))
        if "vllm" in res:
            rows.append((f"vLLM CPU {res['vllm']['kind']}", res["vllm"]["levels"][c]))
        for label, s in rows:
            print(f"c={c:<3} {label:<23}{s['requests']:>5}{_f(s['output_tokens_per_s'], 9, 0)}"
                  f"{_f(s['itl_ms']['p50'], 9)}{_f(s['itl_ms']['p99'], 9)}"
                  f"{_f(s['ttft_ms']['p50'], 10)}" + (f"  errors: {s['errors']}"
                                                      if s["errors"] else ""))
        on, off = res["on"]["levels"][c], res["off"]["levels"][c]
        line = (f"      overlap on/off: tok/s "
                f"{_r(on['output_tokens_per_s'], off['output_tokens_per_s'])}"
                f", ITL p50 {_r(on['itl_ms']['p50'], off['itl_ms']['p50'])}")
        if peer:
            ll = res["llama"]["levels"][c]
            line += (f"; tokenloom(on)/llama.cpp: tok/s "
                     f"{_r(on['output_tokens_per_s'], ll['output_tokens_per_s'])}, ITL p50 "
                     f"{_r(on['itl_ms']['p50'], ll['itl_ms']['p50'])}")
        if "vllm" in res:
            vl = res["vllm"]["levels"][c]
            line += (f"; tokenloom(on)/vLLM: tok/s "
                     f"{_r(on['output_tokens_per_s'], vl['output_tokens_per_s'])}, ITL p50 "
                     f"{_r(on['itl_ms']['p50'], vl['itl_ms']['p50'])}, ITL p99 "
                     f"{_r(on['itl_ms']['p99'], vl['itl_ms']['p99'])}")
        print(line)


def _print_c(res: dict, args) -> None:
    print(f"\n(c) step time{'':<8}{'forward':>9}{'host':>9}{'exposed':>9}{'kv rt':>9}"
          f"{'exposed/(fwd+exposed)':>23}   (ms; steady decode, last 256 steps)")
    for c in args.host_levels:
        for key in ("on", "off"):
            h = res[key]["host"].get(c)
            if not h:
                continue
            t = h["step_time"]
            share = h["exposed_share"]
            print(f"batch {c:<3} overlap {key:<4}{_f(t.get('forward_ms'), 9)}"
                  f"{_f(t.get('host_ms'), 9)}{_f(t.get('exposed_host_ms'), 9)}"
                  f"{_f(t.get('kv_round_trip_ms'), 9)}"
                  f"{(f'{100 * share:.1f} %' if share is not None else '-'):>23}")


# -- (d) ---------------------------------------------------------------------------------
async def _short_streams(url, name, args, rng, seconds: float, with_long: bool) -> dict:
    """interference.py's workload over a fixed duration: --streams slots each streaming
    short requests back to back; with_long: a long prompt every --long-every s meanwhile."""
    import aiohttp

    deadline = time.perf_counter() + seconds
    shorts: list[dict] = []
    longs: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def slot():
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.short_prompt_len)]
                shorts.append(await interference._stream(session, url, name, prompt,
                                                         args.short_output_len))

        t0 = time.perf_counter()
        slots = [asyncio.create_task(slot()) for _ in range(args.streams)]
        if with_long:
            await asyncio.sleep(min(args.long_every, 2.0))   # the streams are decoding
            while time.perf_counter() < deadline:
                prompt = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.long_len)]
                longs.append(asyncio.create_task(interference._stream(
                    session, url, name, prompt, args.long_output)))
                await asyncio.sleep(args.long_every)
        await asyncio.gather(*slots)
        long_results = await asyncio.gather(*longs)
        elapsed = time.perf_counter() - t0
    errors = [r["error"] for r in shorts + long_results if "error" in r]
    gaps = np.array([g for r in shorts if "gaps" in r for g in r["gaps"]]) * 1000
    ttfts = np.array([r["ttft"] for r in long_results if r.get("ttft") is not None]) * 1000
    pct = percentile
    res = {"elapsed_s": elapsed, "errors": len(errors), "short_requests": len(shorts),
           "num_gaps": int(len(gaps)), "num_long_prompts": len(long_results),
           "itl_ms": {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "p99.9": pct(gaps, 99.9),
                      "max": float(gaps.max()) if len(gaps) else None},
           "long_ttft_ms": {"p50": pct(ttfts, 50),
                            "max": float(ttfts.max()) if len(ttfts) else None}}
    if errors:
        res["first_error"] = errors[0]
    if res["itl_ms"]["p50"]:
        res["p99_over_p50"] = res["itl_ms"]["p99"] / res["itl_ms"]["p50"]
    return res


def section_d(args, out: dict) -> None:
    seconds = 8.0 if args.quick else args.interference_seconds
    long_len = 512 if args.quick else args.long_len
    args = argparse.Namespace(**{**vars(args), "long_len": long_len})
    print(f"\n== (d) interference, default model, overlap on: {args.streams} short streams "
          f"({args.short_prompt_len}-token prompts, {args.short_output_len} tokens each, back "
          f"to back) for {seconds:.0f} s, without and with a {long_len}-token prompt every "
          f"{args.long_every:g} s", flush=True)
    res = {"workload": {"streams": args.streams, "short_prompt_len": args.short_prompt_len,
                        "short_output_len": args.short_output_len, "long_len": long_len,
                        "long_output": args.long_output, "long_every": args.long_every,
                        "seconds": seconds}}
    server = serve_tokenloom(args.model, True, args.set)
    url = server.url
    try:
        name = run_async(model_name(url))
        warm_up(url, name, random.Random(args.seed + 300), args.streams)
        for key, with_long in (("without_long", False), ("with_long", True)):
            rng = random.Random(args.seed + (11 if with_long else 10))
            res[key] = run_async(_short_streams(url, name, args, rng, seconds, with_long))
            r = res[key]
            print(f"  {key.replace('_', ' ')}: {r['short_requests']} short requests, "
                  f"{r['num_gaps']} gaps, {r['num_long_prompts']} long prompts, "
                  f"{r['errors']} errors, {r['elapsed_s']:.1f} s", flush=True)
        res["step_time"] = step_times(url)
    finally:
        server.stop()
    a, b = res["without_long"], res["with_long"]
    res["itl_p50_with_over_without"] = _ratio(b["itl_ms"]["p50"], a["itl_ms"]["p50"])
    res["p99_over_p50_with_long"] = b.get("p99_over_p50")
    print(f"\n(d) short-stream ITL (ms){'':<4}{'without long':>14}{'with long':>12}{'ratio':>8}")
    for label, k in (("p50", "p50"), ("p99", "p99"), ("p99.9", "p99.9"), ("max", "max")):
        x, y = a["itl_ms"][k], b["itl_ms"][k]
        print(f"ITL {label:<25}{_f(x, 14)}{_f(y, 12)}{_f(_ratio(y, x), 8, 2)}")
    print(f"{'p99 / p50':<29}{_f(a.get('p99_over_p50'), 14, 2)}"
          f"{_f(b.get('p99_over_p50'), 12, 2)}")
    print(f"{'long prompt TTFT p50 ms':<29}{'-':>14}{_f(b['long_ttft_ms']['p50'], 12)}")
    out["d"] = res


# -- summary -----------------------------------------------------------------------------
def summary_rows(out: dict, args) -> list[tuple[str, str, str, float | None, bool | None]]:
    """(key, target, bound, measured, met) per target of the sections that ran."""
    rows = []
    if "a" in out:
        v = out["a"]["tok_s_on_over_off"]
        rows.append(("a_tok_s_on_over_off", "(a) tiny 64 streams: tok/s overlap on/off",
                     ">= 2.00x", v, None if v is None else v >= 2.0))
    if "b" in out and "llama" in out["b"]:
        b = out["b"]
        for c in b["llama"]["levels"]:
            on, ll = b["on"]["levels"][c], b["llama"]["levels"][c]
            v = _ratio(on["output_tokens_per_s"], ll["output_tokens_per_s"])
            rows.append((f"b_c{c}_tok_s_vs_llama", f"(b) c={c}: tok/s tokenloom/llama.cpp",
                         ">= 1.00x", v, None if v is None else v >= 1.0))
            v = _ratio(on["itl_ms"]["p50"], ll["itl_ms"]["p50"])
            rows.append((f"b_c{c}_itl_p50_vs_llama", f"(b) c={c}: ITL p50 tokenloom/llama.cpp",
                         "<= 1.00x", v, None if v is None else v <= 1.0))
    elif "b" in out:
        rows.append(("b_vs_llama", "(b) tokenloom/llama.cpp (peer skipped)", ">= 1.00x", None,
                     None))
    if "c" in out:
        for c, both in out["c"]["levels"].items():
            share = (both.get("on") or {}).get("exposed_share")
            rows.append((f"c_b{c}_exposed_host_pct", f"(c) batch {c}: exposed host / step, "
                         "overlap on", "< 10 %", None if share is None else 100 * share,
                         None if share is None else share < 0.10))
    if "d" in out:
        d = out["d"]
        v = d["itl_p50_with_over_without"]
        rows.append(("d_itl_p50_with_over_without", "(d) short ITL p50 with/without long",
                     "<= 1.50x", v, None if v is None else v <= 1.5))
        v = d["p99_over_p50_with_long"]
        rows.append(("d_p99_over_p50_with_long", "(d) short ITL p99/p50 with long", "<= 3.00x",
                     v, None if v is None else v <= 3.0))
    return rows


def print_summary(out: dict, args) -> list[tuple]:
    rows = summary_rows(out, args)
    out["summary"] = [{"target": t, "bound": bound, "measured": v, "met": met}
                      for _, t, bound, v, met in rows]
    print(f"\n{'target':<46}{'bound':>10}{'measured':>11}  result"
          + ("   (--quick: smoke test, numbers mean nothing)" if args.quick else ""))
    for _, t, bound, v, met in rows:
        unit = " %" if bound.endswith("%") else "x"
        meas = f"{v:.2f}{unit}" if v is not None else "-"
        print(f"{t:<46}{bound:>10}{meas:>11}  "
              f"{'met' if met else 'MISSED' if met is not None else 'n/a'}")
    return rows


# -- helpers -----------------------------------------------------------------------------
def _ratio(x, y):
    return x / y if x is not None and y else None


def _r(x, y) -> str:
    v = _ratio(x, y)
    return f"{v:.2f}x" if v is not None else "-"


def _f(x, width: int, digits: int = 1) -> str:
    return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"


def _write(args, out: dict) -> None:
    write_raw("engine_loop", out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--section", action="append", choices="abcd", default=[],
                   help="run only these sections (repeatable; default: all)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny request counts")
    p.add_argument("--model", default="default", help="model of (b)-(d)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every tokenloom server")
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("(a)")
    g.add_argument("--tiny-requests", type=int, default=256)
    g.add_argument("--tiny-concurrency", type=int, default=64)
    g = p.add_argument_group("(b) and (c)")
    g.add_argument("--levels", type=_ints, default=[1, 4, 16], help="concurrency levels")
    g.add_argument("--requests-per-slot", type=int, default=3,
                   help="requests per level = max(4, this x concurrency)")
    g.add_argument("--prompt-len", type=int, default=256)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--host-levels", type=_ints, default=[1, 16],
                   help="batch sizes of (c) (must be among --levels to ride on (b))")
    g.add_argument("--host-steps", type=int, default=384,
                   help="tokens per stream of (c)'s steady probe (> 256 + the prefill "
                        "steps: the whole 256-step window is steady decode)")
    g.add_argument("--no-peer", action="store_true", help="skip llama-server")
    g.add_argument("--llama-server", type=Path, default=PEERS / "llama-server")
    g.add_argument("--gguf", type=Path, default=PEERS / "SmolLM2-135M-Instruct.F32.gguf")
    g.add_argument("--llama-threads", type=int, default=2)
    g.add_argument("--llama-ctx-per-slot", type=int, default=512)
    g.add_argument("--vllm", type=Path, default=None, metavar="VENV",
                   help="also run vLLM's CPU build from this venv "
                        "(../shared/peers/install-vllm-cpu.sh)")
    g.add_argument("--vllm-dtype", default="bfloat16")
    g = p.add_argument_group("(d)")
    g.add_argument("--interference-seconds", type=float, default=75.0)
    g.add_argument("--streams", type=int, default=16)
    g.add_argument("--short-prompt-len", type=int, default=64)
    g.add_argument("--short-output-len", type=int, default=256)
    g.add_argument("--long-len", type=int, default=2000)
    g.add_argument("--long-output", type=int, default=16)
    g.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    args = p.parse_args()
    sections = set(args.section or "abcd")
    if args.quick:
        args.output_len = min(args.output_len, 16)
        args.host_steps = min(args.host_steps, 24)
        args.short_output_len = min(args.short_output_len, 32)
        args.long_every = min(args.long_every, 3.0)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    load1 = os.getloadavg()[0]
    if load1 > 0.5:
        print(f"warning: load average {load1:.2f} before the run — the machine is not quiet, "
              f"the numbers will be noisy")
    out: dict = {"args": {k: (str(v) if isinstance(v, Path) else v)
                          for k, v in vars(args).items()},
                 "load_average_at_start": load1}
    if "a" in sections:
        section_a(args, out)
        _write(args, out)
    if "b" in sections or "c" in sections:
        section_bc(args, out, "b" in sections, "c" in sections)
        _write(args, out)
    if "d" in sections:
        section_d(args, out)
        _write(args, out)
    rows = print_summary(out, args)
    _write(args, out)
    table = {"columns": ["target", "bound", "measured", "result"],
             "rows": [[t, bound, v, "met" if met else "MISSED" if met is not None else "n/a"]
                      for _, t, bound, v, met in rows]}
    record_run("engine_loop", {key: v for key, _, _, v, _ in rows}, table, args,
               smoke=args.quick)


if __name__ == "__main__":
    main()
