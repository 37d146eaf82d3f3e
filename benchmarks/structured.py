"""Structured output benchmark: what does a JSON-schema constraint cost?

Default model (fp32, CPU), one engine, measured side by side in one run:

 (a) grammar mask time per token: a constrained answer's tokens replayed through a fresh
     matcher, timing each next-token mask fill (the runner's per-row work), plus applying
     the mask to 16 logits rows;
 (b) decode tokens/s with a JSON-schema constraint vs unconstrained, at batch 1 and 16
     (target: constrained >= 0.90x). The unconstrained requests generate exactly as many
     tokens as their constrained twins (ignore_eos, max_tokens = the constrained length),
     and the modes alternate over rounds (best round of each reported) so drift on a shared
     machine hits both alike. Decode tokens/s: (tokens - 1) / (last - first token time),
     summed over requests at batch 1; the whole batch's tokens over its decode window at 16;
 (c) compile time of a 50-property schema (cold: no cache), after the one-off tokenizer
     tables, which are reported apart.

    python benchmarks/structured.py            # ~2-3 minutes on 2 cores
    python benchmarks/structured.py --quick    # smoke test (numbers mean nothing)
JSON goes to benchmarks/results/structured.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16},
                   "minItems": 4, "maxItems": 6},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 30},
                                   "city": {"type": "string", "maxLength": 20}},
                    "required": ["street", "city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
TOPICS = ["cats", "trains", "gardening", "chess", "jazz", "rockets", "bread", "rivers",
          "tea", "volcanoes", "knitting", "robots", "whales", "castles", "coffee", "poetry"]


def prompts(n: int) -> list[str]:
    return [f"A JSON record describing a user of a forum about {TOPICS[i % len(TOPICS)]}:\n"
            for i in range(n)]


def decode_rate(outputs, batched: bool) -> float:
    comps = [o.outputs[0] for o in outputs]
    if not batched:
        tokens = sum(len(c.token_ids) - 1 for c in comps)
        seconds = sum(c.timings.token_times[-1] - c.timings.token_times[0] for c in comps)
        return tokens / seconds
    # One generate call: arrival times are within microseconds of each other.
    tokens = sum(len(c.token_ids) - 1 for c in comps)
    first = min(c.timings.token_times[0] for c in comps)
    last = max(c.timings.token_times[-1] for c in comps)
    return tokens / (last - first)


def throughput(llm, batch: int, rounds: int, max_tokens: int) -> dict:
    from tokenloom import SamplingParams
    from tokenloom.actors.sampling_params import GuidedDecoding

    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    ps = prompts(batch if batch > 1 else 3)
    best = {"constrained": 0.0, "unconstrained": 0.0}
    lengths, valid = [], 0
    for _ in range(rounds):
        if batch == 1:
            con = [llm.generate([p], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    guided=guided))[0] for p in ps]
        else:
            con = llm.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  guided=guided))
        lengths = [len(o.outputs[0].token_ids) for o in con]
        valid = sum(_is_valid(o.outputs[0].text) for o in con)
        twins = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        if batch == 1:
            unc = [llm.generate([p], sp)[0] for p, sp in zip(ps, twins)]
        else:
            unc = llm.generate(ps, twins)
        best["constrained"] = max(best["constrained"], decode_rate(con, batch > 1))
        best["unconstrained"] = max(best["unconstrained"], decode_rate(unc, batch > 1))
    return {"batch": batch, **best, "ratio": best["constrained"] / best["unconstrained"],
            "tokens_per_request": statistics.mean(lengths), "valid_json": f"{valid}/{len(ps)}"}


def _is_valid(text: str) -> bool:
    try:
        import jsonschema
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:  # noqa: BLE001
        return False


def mask_time(llm, tokenizer, vocab: int, eos) -> dict:
    import torch

    from tokenloom import SamplingParams
    from tokenloom.actors.guided import (GuidedCompiler, GuidedMatcher, allocate_bitmask,
                                         apply_bitmask)
    from tokenloom.actors.sampling_params import GuidedDecoding

    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    out = llm.generate(prompts(4), SamplingParams(temperature=0.8, seed=1, max_tokens=200,
                                                   guided=guided))
    compiler = GuidedCompiler(tokenizer, vocab, eos)
    compiled = compiler.compile(guided)
    fills = []
    for o in out:
        matcher = GuidedMatcher(compiled)
        mask = allocate_bitmask(1, vocab)
        for t in o.outputs[0].token_ids:
            t0 = time.perf_counter()
            matcher.fill(mask, 0)
            fills.append(time.perf_counter() - t0)
            if not matcher.accept(t):
                break
    logits = torch.randn(16, vocab)
    masks = allocate_bitmask(16, vocab)
    applies = []
    for _ in range(50):
        t0 = time.perf_counter()
        apply_bitmask(logits, masks, list(range(16)))
        applies.append(time.perf_counter() - t0)
    fills.sort()
    return {"tokens": len(fills), "fill_mean_us": 1e6 * statistics.mean(fills),
            "fill_p50_us": 1e6 * fills[len(fills) // 2],
            "fill_p99_us": 1e6 * fills[int(len(fills) * 0.99)],
            "apply_16_rows_us": 1e6 * statistics.median(applies)}


def compile_time(tokenizer, vocab: int, eos) -> dict:
    from tokenloom.actors.guided import GuidedCompiler
    from tokenloom.actors.sampling_params import GuidedDecoding

    compiler = GuidedCompiler(tokenizer, vocab, eos)
    t0 = time.perf_counter()
    compiler.compile(GuidedDecoding("regex", "a"))        # builds the tokenizer tables
    tables = time.perf_counter() - t0
    kinds = ["string", "integer", "boolean", "number"]
    times = []
    for rep in range(5):   # distinct schemas: every compile is cold
        props = {f"field_{rep}_{i}": {"type": kinds[i % 4]} for i in range(50)}
        props[f"field_{rep}_0"] = {"type": "string", "enum": ["a", "b", "c"]}
        schema = {"type": "object", "properties": props, "required": list(props)}
        t0 = time.perf_counter()
        compiler.compile(GuidedDecoding("json_schema", json.dumps(schema)))
        times.append(time.perf_counter() - t0)
    return {"tokenizer_tables_s": tables, "schema_50_properties_ms": 1e3 * statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from tokenloom import LLM

    llm = LLM(quiet=True, device="cpu", dtype="float32")
    try:
        tokenizer = llm.engine.tokenizer
        vocab, eos = llm.engine.info.spec.vocab_size, llm.engine.eos_token_ids
        results = {"compile": compile_time(tokenizer, vocab, eos),
                   "mask": mask_time(llm, tokenizer, vocab, eos)}
        rounds = 1 if args.quick else 3
        max_tokens = 40 if args.quick else 200
        results["throughput"] = [throughput(llm, 1, rounds, max_tokens),
                                 throughput(llm, 16, rounds, max_tokens)]
    finally:
        llm.close()
    c, m = results["compile"], results["mask"]
    print(f"mask fill per token: mean {m['fill_mean_us']:.1f} us, p50 {m['fill_p50_us']:.1f} us, "
          f"p99 {m['fill_p99_us']:.1f} us over {m['tokens']} tokens; "
          f"applying 16 rows: {m['apply_16_rows_us']:.0f} us")
    print(f"compile: tokenizer tables {c['tokenizer_tables_s']:.2f} s (once per engine), "
          f"50-property schema {c['schema_50_properties_ms']:.1f} ms (median of 5, cold)")
    print("\n| batch | constrained tok/s | unconstrained tok/s | ratio | tokens/request | valid |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results["throughput"]:
        print(f"| {r['batch']} | {r['constrained']:.1f} | {r['unconstrained']:.1f} | "
              f"{r['ratio']:.3f} | {r['tokens_per_request']:.0f} | {r['valid_json']} |")
    out = Path(__file__).parent / "results" / "structured.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
