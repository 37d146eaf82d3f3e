"""Structured output benchmark: what does a JSON-schema constraint cost?

Default model (fp32, CPU), one engine, measured side by side in one run:

 (a) grammar mask time per token: a constrained answer's tokens replayed through a fresh
     matcher, timing each next-token mask fill (the runner's per-row work), plus applying
     the mask to 16 logits rows;
 (b) decode tokens/s with a JSON-schema constraint vs unconstrained, at batch 1 and 16
     (target: constrained >= 0.90x), with the grammar masks filled on the guided worker
     during the forward and on the runner's thread after it (the engine's default: during
     on CUDA, after on CPU, where a concurrent fill slows the forward). The unconstrained
     requests generate exactly as many tokens as their constrained twins (ignore_eos,
     max_tokens = the constrained length), and the modes alternate over rounds (best
     round of each reported) so drift on a shared machine hits all alike. Decode tokens/s:
     (tokens - 1) / (last - first token time), summed over requests at batch 1; the whole
     batch's tokens over its decode window at 16;
 (c) compile time of a 50-property schema (cold: no cache), after the one-off tokenizer
     tables, which are reported apart;
 (d) constrained + speculative decoding (prompt lookup, speculative "on") vs constrained
     without it, at batch 1 on a repetitive JSON workload (a list of records with the same
     keys, after an example in the prompt); greedy, so both must give the same tokens.

The engine has prompt lookup configured (speculative.method ngram); requests other than
(d)'s speculating ones say speculative "off", so they never propose.

    python benchmarks/structured.py            # ~2-3 minutes on 2 cores
    python benchmarks/structured.py --quick    # smoke test (numbers mean nothing)
The throughput table is the run's record (benchmarks/records.py), the other parts' figures
its summary; every figure goes to benchmarks/raw/structured.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from harness import percentile
from records import record_run, write_raw

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


def _run(llm, ps, params, batch: int):
    if batch == 1:
        return [llm.generate([p], sp)[0] for p, sp in zip(ps, params)]
    return llm.generate(ps, params)


def throughput(llm, batch: int, rounds: int, max_tokens: int) -> dict:
    from tokenloom import SamplingParams
    from tokenloom.actors.sampling_params import GuidedDecoding

    runner = llm.engine.runner.model_runner
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    ps = prompts(batch if batch > 1 else 3)
    best = {"constrained": 0.0, "constrained_masks_after_forward": 0.0, "unconstrained": 0.0}
    lengths, valid, same = [], 0, True
    con_params = [SamplingParams(temperature=0, max_tokens=max_tokens, guided=guided,
                                 speculative="off")] * len(ps)
    for _ in range(rounds):
        default = runner.guided.overlap   # (on by default on CUDA only)
        try:
            runner.guided.overlap = True
            con = _run(llm, ps, con_params, batch)
            runner.guided.overlap = False
            late = _run(llm, ps, con_params, batch)
        finally:
            runner.guided.overlap = default
        lengths = [len(o.outputs[0].token_ids) for o in con]
        valid = sum(_is_valid(o.outputs[0].text) for o in con)
        same &= [o.token_ids for o in late] == [o.token_ids for o in con]
        twins = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, speculative="off")
                 for n in lengths]
        unc = _run(llm, ps, twins, batch)
        for key, outs in (("constrained", con), ("constrained_masks_after_forward", late),
                          ("unconstrained", unc)):
            best[key] = max(best[key], decode_rate(outs, batch > 1))
    assert same, "masks filled during and after the forward gave different tokens"
    return {"batch": batch, **best, "ratio": best["constrained"] / best["unconstrained"],
            "ratio_masks_after_forward": best["constrained_masks_after_forward"]
            / best["unconstrained"],
            "tokens_per_request": statistics.mean(lengths), "valid_json": f"{valid}/{len(ps)}"}


RECORDS = {
    "type": "object",
    "properties": {"users": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"},
                       "name": {"type": "string", "maxLength": 16},
                       "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                       "active": {"type": "boolean"}},
        "required": ["id", "name", "role", "active"], "additionalProperties": False}}},
    "required": ["users"], "additionalProperties": False,
}
EXAMPLE = ('{"users": [{"id": 1, "name": "Ann", "role": "admin", "active": true}, '
           '{"id": 2, "name": "Bob", "role": "viewer", "active": false}]}')


def speculation(llm, rounds: int) -> dict:
    from tokenloom import SamplingParams
    from tokenloom.actors.sampling_params import GuidedDecoding

    guided = GuidedDecoding("json_schema", json.dumps(RECORDS))
    ps = [f"Example: {EXAMPLE}\nThe same for the 8 members of a {t} club, as JSON:\n"
          for t in TOPICS[:3]]
    modes = {"constrained_spec": "on", "constrained": "off"}
    best = dict.fromkeys(modes, 0.0)
    outs = {}
    for _ in range(rounds):
        for key, spec in modes.items():
            outs[key] = _run(llm, ps, [SamplingParams(temperature=0, max_tokens=400,
                                                      guided=guided, speculative=spec)] * 3, 1)
            best[key] = max(best[key], decode_rate(outs[key], False))
    spec_stats = llm.scheduler_stats().spec
    assert [o.token_ids for o in outs["constrained_spec"]] == \
        [o.token_ids for o in outs["constrained"]], "speculation changed greedy output"
    valid = sum(_is_valid(o.outputs[0].text, RECORDS) for o in outs["constrained_spec"])
    return {**best, "ratio": best["constrained_spec"] / best["constrained"],
            "tokens_per_request": statistics.mean(len(o.outputs[0].token_ids)
                                                  for o in outs["constrained"]),
            "valid_json": f"{valid}/{len(ps)}",
            "acceptance": spec_stats.num_accepted_tokens / max(1, spec_stats.num_draft_tokens)}


def _is_valid(text: str, schema=SCHEMA) -> bool:
    try:
        import jsonschema
        jsonschema.validate(json.loads(text), schema)
        return True
    except Exception:  # noqa: BLE001
        return False


def mask_time(llm, tokenizer, vocab: int, eos) -> dict:
    import torch

    from tokenloom import SamplingParams
    from tokenloom.actors.execution.guided import (
        GuidedCompiler,
        GuidedMatcher,
        allocate_bitmask,
        apply_bitmask,
    )
    from tokenloom.actors.sampling_params import GuidedDecoding

    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    out = llm.generate(prompts(4), SamplingParams(temperature=0.8, seed=1, max_tokens=200,
                                                   guided=guided, speculative="off"))
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
    return {"tokens": len(fills), "fill_mean_us": 1e6 * statistics.mean(fills),
            "fill_p50_us": percentile(fills, 50, 1e6),
            "fill_p99_us": percentile(fills, 99, 1e6),
            "apply_16_rows_us": 1e6 * statistics.median(applies)}


def compile_time(tokenizer, vocab: int, eos) -> dict:
    from tokenloom.actors.execution.guided import GuidedCompiler
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

    llm = LLM(quiet=True, device="cpu", dtype="float32", **{"speculative.method": "ngram"})
    try:
        tokenizer = llm.engine.tokenizer
        vocab, eos = llm.engine.info.spec.vocab_size, llm.engine.eos_token_ids
        results = {"compile": compile_time(tokenizer, vocab, eos),
                   "mask": mask_time(llm, tokenizer, vocab, eos)}
        rounds = 1 if args.quick else 3
        max_tokens = 40 if args.quick else 200
        results["throughput"] = [throughput(llm, 1, rounds, max_tokens),
                                 throughput(llm, 16, rounds, max_tokens)]
        results["speculation"] = speculation(llm, rounds)
    finally:
        llm.close()
    c, m = results["compile"], results["mask"]
    print(f"mask fill per token: mean {m['fill_mean_us']:.1f} us, p50 {m['fill_p50_us']:.1f} us, "
          f"p99 {m['fill_p99_us']:.1f} us over {m['tokens']} tokens; "
          f"applying 16 rows: {m['apply_16_rows_us']:.0f} us")
    print(f"compile: tokenizer tables {c['tokenizer_tables_s']:.2f} s (once per engine), "
          f"50-property schema {c['schema_50_properties_ms']:.1f} ms (median of 5, cold)")
    print("\n| batch | masks during forward tok/s | masks after forward tok/s | "
          "unconstrained tok/s | ratio, during | ratio, after | tokens/request | valid |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    columns = ["batch", "masks during forward tok/s", "masks after forward tok/s",
               "unconstrained tok/s", "ratio, during", "ratio, after", "tokens/request", "valid"]
    table = [[r["batch"], r["constrained"], r["constrained_masks_after_forward"],
              r["unconstrained"], r["ratio"], r["ratio_masks_after_forward"],
              r["tokens_per_request"], r["valid_json"]] for r in results["throughput"]]
    for r in results["throughput"]:
        print(f"| {r['batch']} | {r['constrained']:.1f} | "
              f"{r['constrained_masks_after_forward']:.1f} | {r['unconstrained']:.1f} | "
              f"{r['ratio']:.3f} | {r['ratio_masks_after_forward']:.3f} | "
              f"{r['tokens_per_request']:.0f} | {r['valid_json']} |")
    sp = results["speculation"]
    print(f"\nrepetitive JSON, batch 1: constrained + prompt lookup {sp['constrained_spec']:.1f} "
          f"tok/s vs constrained {sp['constrained']:.1f} tok/s: {sp['ratio']:.2f}x "
          f"(acceptance {sp['acceptance']:.2f}, {sp['tokens_per_request']:.0f} tokens/request, "
          f"valid {sp['valid_json']}, same tokens)")
    write_raw("structured", results)
    summary = {f"batch{r['batch']}_ratio": r["ratio"] for r in results["throughput"]}
    summary.update(mask_fill_p50_us=m["fill_p50_us"],
                   schema_50_properties_ms=c["schema_50_properties_ms"],
                   spec_over_constrained=sp["ratio"])
    record_run("structured", summary, {"columns": columns, "rows": table}, args,
               smoke=args.quick)


if __name__ == "__main__":
    main()
