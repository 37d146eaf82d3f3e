"""`tokenloom diagnose BEFORE AFTER`: the before/after comparison of two replays (or
captures) of the same traffic, the mechanisms that explain the change, ranked, and the
incident sentence naming the top one with its figures. Pure module (the report's text, JSON
and HTML renderings are in report.py).

The method is the seed essay's: a user-visible symptom (p95 TTFT, p95 TPOT), a phase-level
split of the TTFT from the traces, the state/locality mechanism behind it (mechanisms.py),
and, for a prefix regression, the token-level diff of a representative request.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from tokenloom.daemon.debug import capture as C
from tokenloom.daemon.debug.mechanisms import Cohort, Finding, find_all, ms, pct, rank
from tokenloom.daemon.debug.prefix_diff import PrefixDiff, common_prefix
from tokenloom.daemon.debug.samples import samples_of
from tokenloom.daemon.debug.summary import Dist, summarize

LATENCY_RATIO = 1.25        # a p95 that moved by less than this is "held"
LATENCY_MIN_S = 0.002       # ... or by less than 2 ms
LATENCY_P = 0.001           # and the shift must be significant (Mann-Whitney U, two-sided)


@dataclasses.dataclass
class Symptom:
    metric: str                 # "TTFT" | "TPOT"
    before: Dist
    after: Dist
    verdict: str                # "regressed" | "improved" | "held"
    p_value: float | None

    def phrase(self) -> str:
        b, a = self.before.p95, self.after.p95
        if self.verdict == "held":
            return f"p95 {self.metric} held ({ms(b)} -> {ms(a)})"
        return f"p95 {self.metric} {self.verdict} {ms(b)} -> {ms(a)}"


@dataclasses.dataclass
class Diagnosis:
    before: Cohort
    after: Cohort
    ttft: Symptom
    tpot: Symptom
    findings: list[Finding]             # ranked; significant ones first
    sentence: str
    prefix_diff: dict | None = None     # the representative request's token-level diff
    block_size: int | None = None

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings and self.findings[0].significant else None


def mann_whitney_p(xs: list[float], ys: list[float]) -> float | None:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with tie
    correction); None below 5 samples a side."""
    xs, ys = [x for x in xs if x is not None], [y for y in ys if y is not None]
    n1, n2 = len(xs), len(ys)
    if n1 < 5 or n2 < 5:
        return None
    ranked = sorted([(v, 0) for v in xs] + [(v, 1) for v in ys])
    ranks = [0.0] * len(ranked)
    ties = 0.0
    i = 0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    r1 = sum(r for r, (_, g) in zip(ranks, ranked) if g == 0)
    u = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / math.sqrt(var)
    return math.erfc(max(0.0, z) / math.sqrt(2))


def symptom(metric: str, before: list[float], after: list[float]) -> Symptom:
    db, da = Dist.of(before), Dist.of(after)
    p = mann_whitney_p(before, after)
    verdict = "held"
    if db.p95 is not None and da.p95 is not None and p is not None and p < LATENCY_P:
        if da.p95 >= db.p95 * LATENCY_RATIO and da.p95 - db.p95 >= LATENCY_MIN_S:
            verdict = "regressed"
        elif db.p95 >= da.p95 * LATENCY_RATIO and db.p95 - da.p95 >= LATENCY_MIN_S:
            verdict = "improved"
    return Symptom(metric, db, da, verdict, p)


def cohort(name: str, cap: C.Capture) -> Cohort:
    samples = samples_of(cap.records)
    return Cohort(name, samples, summarize(samples, cap.server))


def incident_sentence(ttft: Symptom, tpot: Symptom, ranked: list[Finding],
                      b: Cohort, a: Cohort) -> str:
    sig = [f for f in ranked if f.significant]
    if not sig:
        sb, sa = b.summary, a.summary
        moved = [s for s in (ttft, tpot) if s.verdict != "held"]
        figures = (f"hit rate {pct(sb.hit_rate)} -> {pct(sa.hit_rate)}, preemptions per "
                   f"request {sb.preemptions_per_request:.2f} -> "
                   f"{sa.preemptions_per_request:.2f}, prefill tokens per request "
                   f"{sb.prefill_tokens_mean:.0f} -> {sa.prefill_tokens_mean:.0f}")
        if not moved:
            return (f"No significant change: {ttft.phrase()} and {tpot.phrase()}; no "
                    f"mechanism moved ({figures}).")
        return (f"{'; '.join(s.phrase() for s in moved)}, but no mechanism in the traces "
                f"explains it ({figures}): the cause is outside what the engine records "
                f"(host load, network, client).")
    top = sig[0]
    main, other = (ttft, tpot) if top.symptom == "ttft" else (tpot, ttft)
    if main.verdict == "held":
        head = (f"No {main.metric} regression yet (p95 {ms(main.before.p95)} -> "
                f"{ms(main.after.p95)}), but")
    else:
        head = f"{main.phrase()} because"
    consequences = [f for f in sig[1:] if f.name in top.explains and f.consequence]
    tail = ""
    if consequences:
        tail = ", which also brought " + " and ".join(f.consequence for f in consequences)
    if other.verdict == "held":
        other_clause = f", while {other.metric} stayed healthy (p95 {ms(other.before.p95)} -> " \
                       f"{ms(other.after.p95)})"
    elif other.verdict == "regressed":
        other_clause = f"; p95 {other.metric} also regressed {ms(other.before.p95)} -> " \
                       f"{ms(other.after.p95)}"
    else:
        other_clause = f"; p95 {other.metric} improved {ms(other.before.p95)} -> " \
                       f"{ms(other.after.p95)}"
    return f"{head} {top.because}{tail}{other_clause}."


def representative_diff(b: Cohort, a: Cohort, window: int = 64) -> dict | None:
    """For a prefix regression: the after-request that lost the most cached tokens, and the
    earlier request it shared the most with in the before run (its cache donor), diffed in
    both runs. Needs prompt token ids (replays of tokenloom have them)."""
    before = {s.index: s for s in b.samples if s.ok and s.prompt_token_ids}
    after = {s.index: s for s in a.samples if s.ok and s.prompt_token_ids}
    common = sorted(set(before) & set(after))
    if len(common) < 2:
        return None
    lost = max(common[1:], key=lambda i: before[i].cached_tokens - after[i].cached_tokens)
    earlier = [j for j in common if j < lost][-window:]
    donor = max(earlier, key=lambda j: common_prefix(before[lost].prompt_token_ids,
                                                     before[j].prompt_token_ids))
    out = {"request": lost, "donor": donor}
    for name, run in (("before", before), ("after", after)):
        x, y = run[donor].prompt_token_ids, run[lost].prompt_token_ids
        out[name] = {"donor_ids": x, "request_ids": y, "common": common_prefix(x, y),
                     "cached_tokens": run[lost].cached_tokens}
    return out


def render_diff(d: dict, block_size: int, tokenizer=None, context: int = 8) -> str:
    """prefix-diff's rendering of the representative pair, before and after."""
    from tokenloom.daemon.debug.prefix_diff import render

    lines = [f"request #{d['request']} against #{d['donor']} (the request it shared the most "
             f"with before):"]
    for name in ("before", "after"):
        r = d[name]
        x, y = r["donor_ids"], r["request_ids"]
        diff = PrefixDiff(len(x), len(y), r["common"], block_size)
        lines.append(f"[{name}] (server reported {r['cached_tokens']} cached tokens)")
        if tokenizer is not None:
            text = render(tokenizer, x, y, diff, names=(f"#{d['donor']}", f"#{d['request']}"),
                          context=context)
        else:
            lo = max(0, diff.common - context)
            text = (f"first difference at token {diff.common} (block "
                    f"{diff.first_divergent_block}); #{d['donor']}: ...{x[lo:diff.common]} then "
                    f"{x[diff.common:diff.common + context]}; #{d['request']}: ..."
                    f"{y[lo:diff.common]} then {y[diff.common:diff.common + context]}; "
                    f"reusable {diff.reusable_tokens} tokens")
        lines += ["  " + line for line in text.splitlines()]
    return "\n".join(lines)


def diagnose(before: C.Capture, after: C.Capture, names=("before", "after")) -> Diagnosis:
    b, a = cohort(names[0], before), cohort(names[1], after)

    def tpot_values(c: Cohort) -> list[float]:
        return [s.tpot for s in c.samples if s.ok and s.tpot is not None]
    ttft = symptom("TTFT", [s.ttft for s in b.samples if s.ok and s.ttft is not None],
                   [s.ttft for s in a.samples if s.ok and s.ttft is not None])
    tpot = symptom("TPOT", tpot_values(b), tpot_values(a))
    ranked = rank(find_all(b, a))
    sentence = incident_sentence(ttft, tpot, ranked, b, a)
    block = before.header.get("block_size") or after.header.get("block_size")
    diag = Diagnosis(b, a, ttft, tpot, ranked, sentence, block_size=block)
    if diag.top is not None and diag.top.name in ("prefix_layout", "prefix_eviction",
                                                   "isolation"):
        diag.prefix_diff = representative_diff(b, a)
    return diag


def diagnose_files(before: str | Path, after: str | Path) -> Diagnosis:
    return diagnose(C.load(before), C.load(after),
                    names=(Path(before).stem or "before", Path(after).stem or "after"))
