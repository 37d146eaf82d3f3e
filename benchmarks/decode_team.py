"""One OpenMP team per decode step against one team per kernel, side by side.

The C++ decode stack (kernels/cpu/decode_stack.py) runs a decode-only step's layers either
as one parallel region whose threads meet at a spin barrier (csrc/team.h, the default) or
with a fork and join of the OpenMP team around every projection and attention call (the
per-call path, `use_team(False)`). Both compute the same tiles and sums: the outputs are
bit-identical, and this script checks that the greedy tokens are too.

For each mode the offline engine serves `--streams` concurrent greedy requests (1: batch-1
decode) at ~`--context` tokens of prompt, `--tokens` tokens long, alternating the two
paths in the same process for `--rounds` rounds; the figure is the median inter-token
latency (the engine's token timestamps: the whole step, Python included). Prints each
mode's best and median per path and their ratio (per-call / team: > 1 is the team faster)
and records them (benchmarks/records.py; every round in benchmarks/raw/decode_team.json).

    python benchmarks/decode_team.py                      # make serve's mode, 3 rounds
    python benchmarks/decode_team.py --modes q4-kv16 fp32-kv16 bf16 int8 --context 1100
    python benchmarks/decode_team.py --modes bf16 int8 --streams 16 --context 32 --tokens 64
"""

from __future__ import annotations

import argparse
import statistics

from records import record_run, write_raw

MODES = {
    "q4-kv16": dict(dtype="float32", weight_dtype="q4", kv_dtype="fp16"),
    "q8-kv16": dict(dtype="float32", weight_dtype="q8", kv_dtype="fp16"),
    "fp32-kv16": dict(dtype="float32", kv_dtype="fp16"),
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(dtype="bfloat16", weight_dtype="int8"),
}


def itl_ms(outputs) -> float:
    """The median over requests of each request's median gap between tokens."""
    per_request = []
    for out in outputs:
        times = out.outputs[0].timings.token_times
        per_request.append(statistics.median(b - a for a, b in zip(times, times[1:])))
    return statistics.median(per_request) * 1e3


def run_mode(mode: str, args) -> dict:
    from tokenloom import LLM, SamplingParams
    from tokenloom.kernels.cpu import decode_stack

    llm = LLM(device="cpu", quiet=True, enable_prefix_caching=False, **MODES[mode])
    try:
        prompt = [[1000 + (i * 7 + j * 13) % 3000 for i in range(args.context)]
                  for j in range(args.streams)]
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        stacks = decode_stack.module()
        itl = {"team": [], "per_call": []}
        tokens = {}
        try:
            for _ in range(args.rounds):
                for path in ("team", "per_call"):
                    stacks.use_team(path == "team")
                    outs = llm.generate(prompt, params)
                    itl[path].append(itl_ms(outs))
                    tokens[path] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            stacks.use_team(True)
    finally:
        llm.close()
    return {
        "itl_ms": itl,
        "best_ratio": min(itl["per_call"]) / min(itl["team"]),
        "median_ratio": statistics.median(itl["per_call"]) / statistics.median(itl["team"]),
        "same_tokens": tokens["team"] == tokens["per_call"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=["q4-kv16"], choices=list(MODES))
    ap.add_argument("--context", type=int, default=300, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=200, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=1,
                    help="concurrent requests (decode rows a step)")
    args = ap.parse_args()
    results, rows = {}, []
    print(f"ITL at {args.streams} stream(s), ~{args.context} tokens of prompt, "
          f"{args.rounds} alternating rounds "
          "(ms: best / median; ratio per-call / team, > 1: the team faster)")
    for mode in args.modes:
        r = results[mode] = run_mode(mode, args)
        team, calls = r["itl_ms"]["team"], r["itl_ms"]["per_call"]
        print(f"{mode:10s} team {min(team):6.2f} / {statistics.median(team):6.2f}   "
              f"per-call {min(calls):6.2f} / {statistics.median(calls):6.2f}   "
              f"ratio {r['best_ratio']:.3f} / {r['median_ratio']:.3f}   "
              f"same tokens: {r['same_tokens']}", flush=True)
        rows.append([mode, min(team), statistics.median(team), min(calls),
                     statistics.median(calls), r["best_ratio"], r["median_ratio"],
                     r["same_tokens"]])
    write_raw("decode_team", {"context": args.context, "tokens": args.tokens,
                              "streams": args.streams, "rounds": args.rounds, "modes": results})
    columns = ["mode", "team best ms", "team median ms", "per-call best ms",
               "per-call median ms", "ratio (best)", "ratio (median)", "same tokens"]
    summary = {f"{mode}_median_ratio": r["median_ratio"] for mode, r in results.items()}
    record_run("decode_team", summary, {"columns": columns, "rows": rows}, args)


if __name__ == "__main__":
    main()
