"""Speculative decoding benchmark: does prompt lookup pay where it should, and cost
nothing where it cannot?

One engine (default model, fp32, CPU) with `speculative.method = "ngram"`; each request
picks `speculative` "off", "auto" or "on", so every ratio compares the same engine in the
same run. Workloads:

 (a) lookup-friendly, batch 1: chat prompts asking the model to repeat or lightly edit a
     passage (what it writes is mostly in its prompt). Decode tokens/s off / auto / on,
     greedy text identical to off, acceptance per draft position.
     Target: auto >= 1.8x off.
 (b) random-word prompts, batch 1, sampled at temperature 1 (nothing to look up):
     auto within 3% of off. Also greedy, reported: a small model's greedy output on
     random words soon loops, and then prompt lookup finds its own output.
 (c) 16 concurrent streams of random-word prompts, greedy and sampled: auto within 3% of
     off (output tokens/s over the whole batch, best of 3 rounds).
(b) and (c) ignore EOS so that every mode generates the same number of tokens.

Decode tokens/s of a request: (tokens - 1) / (last token time - first token time); a
workload's figure is the total over its requests. Each mode's requests are interleaved
(off, auto, on, off, ...) so that drift on a shared machine hits all modes alike.

    python benchmarks/speculative.py            # ~3-5 minutes on 2 cores
    python benchmarks/speculative.py --quick    # smoke test (numbers mean nothing)
The markdown table is the run's record (benchmarks/records.py), the ratios its summary;
every figure goes to benchmarks/raw/speculative.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from tokenloom import LLM, SamplingParams

from records import record_run, write_raw

PASSAGES = [
    "The lighthouse keeper counted the ships that night and wrote each name in the ledger: "
    "the Albatross, the Meridian, the Quiet Harbour. Rain struck the glass while the lamp "
    "turned, and at dawn he walked down to the harbour to see which of them had come home.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < "
    "len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n"
    "    out.extend(b[j:])\n    return out\n",
    "Copper is a soft, malleable and ductile metal with very high thermal and electrical "
    "conductivity. It is used as a conductor of heat and electricity, as a building material, "
    "and as a constituent of various metal alloys such as sterling silver and bronze.",
    "Our meeting is moved from Tuesday to Thursday at 3 pm in room 204. Please bring the "
    "quarterly figures, the draft budget for the new office, and your notes on the hiring "
    "plan. Lunch will be provided. Reply to this message if you cannot attend.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{p}",
    "Copy this passage, changing nothing:\n\n{p}",
    "Rewrite the following text, keeping every sentence as it is but fixing any typos:\n\n{p}",
]


def lookup_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": INSTRUCTIONS[i % len(INSTRUCTIONS)].format(
        p=PASSAGES[i % len(PASSAGES)])}] for i in range(n)]


def random_prompts(tokenizer, n: int, words: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3][:20000]
    return [tokenizer.encode(" ".join(rng.choice(vocab) for _ in range(words)))
            for _ in range(n)]


def decode_rate(outs) -> float:
    tokens, seconds = 0, 0.0
    for o in outs:
        t = o.outputs[0].timings.token_times
        if len(t) > 1:
            tokens += len(t) - 1
            seconds += t[-1] - t[0]
    return tokens / seconds if seconds else 0.0


def run_mode(llm, prompts, mode, max_tokens, chat, temperature=0.0) -> list:
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, speculative=mode,
                            ignore_eos=not chat, seed=None if temperature == 0 else 1234)
    if chat:
        return llm.chat(prompts, params)
    return llm.generate(prompts, params)


def batch1(llm, prompts, modes, max_tokens, chat, rounds, temperature=0.0):
    """Each prompt alone, modes interleaved; returns {mode: [outputs]}."""
    outs = {m: [] for m in modes}
    for _ in range(rounds):
        for p in prompts:
            for m in modes:
                outs[m].append(run_mode(llm, [p], m, max_tokens, chat, temperature)[0])
    return outs


def spec_delta(before, after) -> dict:
    per_pos = [a - (before.accepted_per_position[j] if j < len(before.accepted_per_position)
                    else 0) for j, a in enumerate(after.accepted_per_position)]
    drafts = after.num_drafts - before.num_drafts
    return {"num_drafts": drafts,
            "draft_tokens": after.num_draft_tokens - before.num_draft_tokens,
            "accepted_tokens": after.num_accepted_tokens - before.num_accepted_tokens,
            "acceptance_per_position": [round(a / drafts, 3) if drafts else None
                                        for a in per_pos]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    quick = args.quick
    max_tokens = 24 if quick else 96
    llm = LLM(quiet=True, dtype="float32", device="cpu",
              **{"speculative.method": "ngram", "speculative.num_speculative_tokens": args.k})
    results: dict = {"k": args.k, "quick": quick}
    rows = []
    try:
        # Warm-up (and the cost model's first fit): a few steps of each kind.
        run_mode(llm, lookup_prompts(2), "off", 32, chat=True)
        run_mode(llm, random_prompts(llm.tokenizer, 4, 40, 0), "off", 32, chat=False)

        # (a) lookup-friendly, batch 1
        prompts = lookup_prompts(2 if quick else 6)
        before = llm.scheduler_stats().spec
        outs = batch1(llm, prompts, ("off", "auto", "on"), max_tokens, True, 1)
        spec_a = spec_delta(before, llm.scheduler_stats().spec)
        same = all(a.token_ids == b.token_ids for a, b in zip(outs["off"], outs["auto"])) and \
            all(a.token_ids == b.token_ids for a, b in zip(outs["off"], outs["on"]))
        rates = {m: decode_rate(o) for m, o in outs.items()}
        results["a_lookup_batch1"] = {"decode_tok_s": rates, "identical_greedy_text": same,
                                      "speculation": spec_a}
        rows.append(("(a) lookup, batch 1: auto / off", rates["auto"] / rates["off"], ">= 1.8"))
        rows.append(("(a) lookup, batch 1: on / off", rates["on"] / rates["off"], "-"))

        # (b) random words, batch 1: sampled (the target) and greedy (reported)
        prompts = random_prompts(llm.tokenizer, 2 if quick else 6, 60, 1)
        for name, temp in (("sampled", 1.0), ("greedy", 0.0)):
            before = llm.scheduler_stats().spec
            outs = batch1(llm, prompts, ("off", "auto"), max_tokens, False, 1, temp)
            rates = {m: decode_rate(o) for m, o in outs.items()}
            results[f"b_random_batch1_{name}"] = {
                "decode_tok_s": rates,
                "speculation": spec_delta(before, llm.scheduler_stats().spec)}
            rows.append((f"(b) random {name}, batch 1: auto / off",
                         rates["auto"] / rates["off"], ">= 0.97" if temp else "-"))

        # (c) 16 concurrent random-word streams, greedy and sampled
        prompts = random_prompts(llm.tokenizer, 16, 60, 2)
        for name, temp in (("greedy", 0.0), ("sampled", 1.0)):
            modes = ("off", "auto", "on") if temp == 0 else ("off", "auto")
            rates = {m: [] for m in modes}
            before = llm.scheduler_stats().spec
            for _ in range(1 if quick else 3):
                for m in modes:
                    t0 = time.perf_counter()
                    o = run_mode(llm, prompts, m, max_tokens, False, temp)
                    rates[m].append(sum(len(x.token_ids) for x in o)
                                    / (time.perf_counter() - t0))
            best = {m: max(v) for m, v in rates.items()}
            results[f"c_random_16_streams_{name}"] = {
                "output_tok_s": rates,
                "speculation": spec_delta(before, llm.scheduler_stats().spec)}
            rows.append((f"(c) random {name}, 16 streams: auto / off",
                         best["auto"] / best["off"], ">= 0.97"))
            if "on" in best:
                rows.append((f"(c) random {name}, 16 streams: on / off",
                             best["on"] / best["off"], "-"))
        results["cost_model"] = llm.scheduler_stats().cost_model
    finally:
        llm.close()
    print(f"\nspeculative decoding (prompt lookup, k={args.k}), default model fp32, CPU")
    print(f"{'measure':40} {'ratio':>7}  target")
    for name, ratio, target in rows:
        print(f"{name:40} {ratio:7.2f}  {target}")
    a = results["a_lookup_batch1"]
    print(f"(a) decode tok/s off {a['decode_tok_s']['off']:.1f}, auto "
          f"{a['decode_tok_s']['auto']:.1f}, on {a['decode_tok_s']['on']:.1f}; greedy text "
          f"identical: {a['identical_greedy_text']}")
    print(f"(a) acceptance per position: {a['speculation']['acceptance_per_position']}")
    for key in ("b_random_batch1_sampled", "b_random_batch1_greedy",
                "c_random_16_streams_greedy", "c_random_16_streams_sampled"):
        sp = results[key]["speculation"]
        print(f"{key}: {sp['num_drafts']} drafts verified, acceptance per position "
              f"{sp['acceptance_per_position']}")
    print("\nmarkdown (tokens/s; decode rate at batch 1, output rate at 16 streams):")
    columns = ["workload", "off", "auto", "on", "auto / off", "on / off"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    table = []
    for key, label in (("a_lookup_batch1", "(a) repeat/edit a passage, batch 1, greedy"),
                       ("b_random_batch1_sampled", "(b) random words, batch 1, sampled"),
                       ("b_random_batch1_greedy", "(b) random words, batch 1, greedy"),
                       ("c_random_16_streams_greedy", "(c) random words, 16 streams, greedy"),
                       ("c_random_16_streams_sampled",
                        "(c) random words, 16 streams, sampled")):
        r = results[key]
        v = r.get("decode_tok_s") or {m: max(x) for m, x in r["output_tok_s"].items()}
        on = f"{v['on']:.1f}" if "on" in v else "-"
        on_ratio = f"{v['on'] / v['off']:.2f}x" if "on" in v else "-"
        print(f"| {label} | {v['off']:.1f} | {v['auto']:.1f} | {on} | "
              f"{v['auto'] / v['off']:.2f}x | {on_ratio} |")
        table.append([label, v["off"], v["auto"], v.get("on"), f"{v['auto'] / v['off']:.2f}x",
                      on_ratio])
    results["ratios"] = {name: round(r, 3) for name, r, _ in rows}
    write_raw("speculative", results)
    record_run("speculative", results["ratios"], {"columns": columns, "rows": table}, args,
               smoke=quick)


if __name__ == "__main__":
    sys.exit(main())
