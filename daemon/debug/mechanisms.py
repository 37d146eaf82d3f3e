"""The mechanisms a before/after change can have, each a function of the two cohorts that
returns a `Finding` (with its figures and the clause of the incident sentence) or None.
Pure module.

A finding is significant when its `score` (its evidence in units of its threshold) is at
least 1. Thresholds are deliberately coarse: they separate a planted cause from run-to-run
noise, and every one of them is a count or a share from the traces (hit rate, preemptions,
tokens per prefill chunk, acceptance, request shares), never a latency alone — latency is
the symptom the mechanism has to explain. The one exception, `compute_slowdown` (the same
work got slower), asks for a 2.5x change in both prefill time per token and decode gaps.

`explains` names the findings a mechanism causes downstream (a tenant flooding long
prompts also fills the KV pool): the ranking puts causes before their consequences.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable

from tokenloom.daemon.debug.samples import Sample
from tokenloom.daemon.debug.summary import Dist, Summary, percentile

HIT_RATE_DROP = 0.15          # absolute drop of the token-weighted prefix-cache hit rate
PREFILL_GROWTH = 1.25         # prefill tokens per request, after / before
TENANT_SHARE_RISE = 0.20      # a tenant's share of prompt tokens, absolute rise
PREEMPTIONS_RISE = 0.10       # preemptions per request, absolute rise
REFUSALS_RISE = 1.0           # steps waiting on a refused KV plan per request, absolute rise
CHUNK_GROWTH = 1.5            # prefill tokens per chunk, after / before
GAP_GROWTH = 1.3              # p95 of the largest decode gap per request, after / before
ACCEPTANCE_DROP = 0.20        # speculative acceptance (accepted / drafted), absolute drop
WORKER_SHARE_RISE = 0.20      # the busiest worker's share of requests, absolute rise
SLOWDOWN = 2.5                # compute_slowdown: both per-token prefill and decode gaps


@dataclasses.dataclass
class Cohort:
    name: str
    samples: list[Sample]
    summary: Summary


@dataclasses.dataclass
class Finding:
    name: str
    title: str
    score: float
    symptom: str                        # "ttft" or "tpot": what it makes worse
    because: str                        # the clause after "because" in the sentence
    evidence: list[str]
    figures: dict
    explains: tuple[str, ...] = ()
    consequence: str = ""               # how a cause names it ("N preemptions")

    @property
    def significant(self) -> bool:
        return self.score >= 1.0


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def ms(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s"


def _pairs(b: Cohort, a: Cohort) -> list[tuple[Sample, Sample]]:
    by_index = {s.index: s for s in b.samples if s.ok}
    return [(by_index[s.index], s) for s in a.samples if s.ok and s.index in by_index]


def shared_prefix(samples: list[Sample], window: int = 64) -> float | None:
    """Median over requests of the longest token prefix shared with any of the `window`
    requests before it (by capture order): how far requests agree before they diverge."""
    seqs = [s.prompt_token_ids for s in sorted(samples, key=lambda s: s.index)
            if s.prompt_token_ids]
    if len(seqs) < 2:
        return None
    from tokenloom.daemon.debug.prefix_diff import common_prefix
    best = [max(common_prefix(seqs[i], seqs[j]) for j in range(max(0, i - window), i))
            for i in range(1, len(seqs))]
    return percentile(best, 50)


# -- the mechanisms ------------------------------------------------------------------------
def prefix_cache(b: Cohort, a: Cohort) -> Finding | None:
    """Hit rate fell and prefill grew; the dominant first-miss reason of the requests that
    lost hits tells layout (no_prefix, partial_block) from eviction and isolation."""
    sb, sa = b.summary, a.summary
    drop = sb.hit_rate - sa.hit_rate
    if drop <= 0 or sb.requests == 0:
        return None
    growth = (sa.prefill_tokens_mean + 1) / (sb.prefill_tokens_mean + 1)
    lost = [s for p, s in _pairs(b, a) if s.cached_tokens < p.cached_tokens] or \
        [s for s in a.samples if s.ok and s.cached_tokens == 0]
    reasons = Counter(s.miss_reason or "no_prefix" for s in lost)
    reason = reasons.most_common(1)[0][0] if reasons else "no_prefix"
    score = min(drop / HIT_RATE_DROP, growth / PREFILL_GROWTH)
    pos_b = percentile(sb.first_miss_positions, 50)
    pos_a = percentile(sa.first_miss_positions, 50)
    figures = {"hit_rate": [sb.hit_rate, sa.hit_rate],
               "prefill_tokens_per_request": [sb.prefill_tokens_mean, sa.prefill_tokens_mean],
               "first_miss_position_p50": [pos_b, pos_a], "miss_reasons_after": dict(reasons),
               "lost_requests": len(lost)}
    hits = (f"prefix-cache hits fell {pct(sb.hit_rate)} -> {pct(sa.hit_rate)} and prefill "
            f"tokens per request rose {sb.prefill_tokens_mean:.0f} -> "
            f"{sa.prefill_tokens_mean:.0f}")
    evidence = [hits, f"first miss at token {pos_b:.0f} -> {pos_a:.0f} (median)"
                if pos_a is not None and pos_b is not None else "",
                f"first-miss reasons of the {len(lost)} requests that lost hits: "
                + ", ".join(f"{k} {v}" for k, v in reasons.most_common())]
    if reason == "evicted":
        return Finding("prefix_eviction", "cached prefix evicted, then recomputed", score,
                       "ttft", f"the shared prefix was evicted from the KV pool before it "
                       f"was reused ({reasons['evicted']} requests missed with reason "
                       f"`evicted`), so {hits}", [e for e in evidence if e], figures,
                       consequence="prefix evictions")
    if reason == "isolation":
        return Finding("isolation", "cache salt / tenant isolation split the cache", score,
                       "ttft", f"the same prompts now arrive under different cache salts "
                       f"({reasons['isolation']} requests missed with reason `isolation`), "
                       f"so {hits}", [e for e in evidence if e], figures,
                       explains=("prefill_interference",))
    shared_b, shared_a = shared_prefix(b.samples), shared_prefix(a.samples)
    figures["shared_prefix_tokens_p50"] = [shared_b, shared_a]
    if shared_a is not None and shared_b is not None:
        where = (f"requests now diverge from each other at token {shared_a:.0f} "
                 f"(was {shared_b:.0f})")
    else:
        where = f"the first miss moved to token {pos_a:.0f} (was {pos_b:.0f})"
    return Finding("prefix_layout", "prompt layout broke prefix reuse", score, "ttft",
                   f"the prompt layout moved request-specific (volatile) content ahead of the "
                   f"stable shared prefix: {where}, so {hits}", [e for e in evidence if e],
                   figures, explains=("prefill_interference", "kv_pressure"))


def noisy_tenant(b: Cohort, a: Cohort) -> Finding | None:
    """One tenant's share of prompt tokens rose sharply and the other tenants waited."""
    ta, tb = a.summary.tenants, b.summary.tenants
    if len(ta) < 2:
        return None
    rise = {t: g.prompt_token_share - (tb[t].prompt_token_share if t in tb else 0.0)
            for t, g in ta.items()}
    tenant = max(rise, key=rise.get)
    if rise[tenant] <= 0:
        return None
    others_b = [s for s in b.samples if s.ok and s.tenant != tenant]
    others_a = [s for s in a.samples if s.ok and s.tenant != tenant]
    ttft_b = percentile([s.ttft for s in others_b if s.ttft is not None], 95)
    ttft_a = percentile([s.ttft for s in others_a if s.ttft is not None], 95)
    wait = lambda ss: percentile([s.phases.get("queue", 0) + s.phases.get("prefill_wait", 0)  # noqa
                                  for s in ss if s.phases], 95)
    wait_b, wait_a = wait(others_b), wait(others_a)
    hurt = ttft_a is not None and ttft_b is not None and ttft_a > 1.2 * ttft_b
    score = rise[tenant] / TENANT_SHARE_RISE * (1.0 if hurt else 0.5)
    g = ta[tenant]
    share_b = tb[tenant].prompt_token_share if tenant in tb else 0.0
    return Finding(
        "noisy_tenant", f"tenant {tenant!r} floods long prompts", score, "ttft",
        f"tenant {tenant!r} flooded long prompts: its share of prompt tokens rose "
        f"{pct(share_b)} -> {pct(g.prompt_token_share)} ({g.requests} requests of "
        f"{g.prompt_tokens_mean:.0f} tokens on average), so the other tenants waited "
        f"(their p95 queue + prefill wait {ms(wait_b)} -> {ms(wait_a)}, p95 TTFT "
        f"{ms(ttft_b)} -> {ms(ttft_a)})",
        [f"tenant {tenant!r}: {pct(share_b)} -> {pct(g.prompt_token_share)} of prompt tokens",
         f"other tenants' p95 TTFT {ms(ttft_b)} -> {ms(ttft_a)}"],
        {"tenant": tenant, "prompt_token_share": [share_b, g.prompt_token_share],
         "others_ttft_p95": [ttft_b, ttft_a], "others_wait_p95": [wait_b, wait_a]},
        explains=("kv_pressure", "prefill_interference", "prefix_eviction",
                  "router_imbalance", "compute_slowdown"))


def kv_pressure(b: Cohort, a: Cohort) -> Finding | None:
    """Preemptions and refused KV plans rose: the pool is too small for the load."""
    sb, sa = b.summary, a.summary
    dp = sa.preemptions_per_request - sb.preemptions_per_request
    dr = sa.kv_refusals_per_request - sb.kv_refusals_per_request
    if dp <= 0 and dr <= 0:
        return None
    score = max(dp / PREEMPTIONS_RISE, dr / REFUSALS_RISE)
    if sa.preemptions_per_request < 2 * sb.preemptions_per_request and \
            sa.kv_refusals_per_request < 2 * sb.kv_refusals_per_request:
        score = min(score, 0.5)
    usage = [sb.server.get("kv_usage_max"), sa.server.get("kv_usage_max")]
    pre = round(sa.preemptions_per_request * sa.requests)
    return Finding(
        "kv_pressure", "KV pool too small (preemptions, refused plans)", score, "ttft",
        f"the KV pool ran out: preemptions per request rose "
        f"{sb.preemptions_per_request:.2f} -> {sa.preemptions_per_request:.2f} and steps "
        f"waiting on a refused KV plan per request {sb.kv_refusals_per_request:.1f} -> "
        f"{sa.kv_refusals_per_request:.1f}"
        + (f" (peak pool usage {pct(usage[0])} -> {pct(usage[1])})"
           if usage[1] is not None else ""),
        [f"preemptions/request {sb.preemptions_per_request:.2f} -> "
         f"{sa.preemptions_per_request:.2f}",
         f"KV refusals/request {sb.kv_refusals_per_request:.1f} -> "
         f"{sa.kv_refusals_per_request:.1f}"],
        {"preemptions_per_request": [sb.preemptions_per_request, sa.preemptions_per_request],
         "kv_refusals_per_request": [sb.kv_refusals_per_request, sa.kv_refusals_per_request],
         "kv_usage_max": usage},
        explains=("prefix_eviction", "prefill_interference"),
        consequence=f"{pre} preemptions")


def prefill_interference(b: Cohort, a: Cohort) -> Finding | None:
    """Prefill chunks grew and decode gaps with them: a step that prefills a big chunk
    holds every running stream's next token (the chunk is too large for the ITL target)."""
    sb, sa = b.summary, a.summary
    cb, ca = sb.prefill_tokens_per_chunk, sa.prefill_tokens_per_chunk
    gb, ga = sb.decode_max_gap.p95, sa.decode_max_gap.p95
    if not (cb and ca and gb and ga):
        return None
    chunk, gap = ca / cb, ga / gb
    if chunk <= 1 or gap <= 1:
        return None
    score = min(chunk / CHUNK_GROWTH, gap / GAP_GROWTH)
    return Finding(
        "prefill_interference", "prefill chunks too large for the ITL target", score, "tpot",
        f"prefill chunks grew from {cb:.0f} to {ca:.0f} tokens, so each step that prefills "
        f"holds the running streams' next token longer (p95 of the longest decode gap "
        f"{ms(gb)} -> {ms(ga)})",
        [f"prefill tokens per chunk {cb:.0f} -> {ca:.0f}",
         f"p95 longest decode gap {ms(gb)} -> {ms(ga)}"],
        {"prefill_tokens_per_chunk": [cb, ca], "decode_max_gap_p95": [gb, ga]},
        consequence="longer decode stalls behind prefill")


def spec_collapse(b: Cohort, a: Cohort) -> Finding | None:
    """Speculative acceptance collapsed (or the kill switch stopped drafting)."""
    sb, sa = b.summary, a.summary
    if not sb.spec_drafted:
        return None
    acc_b = sb.spec_acceptance
    acc_a = sa.spec_acceptance if sa.spec_drafted else 0.0
    drop = acc_b - acc_a
    if drop <= 0:
        return None
    drafted_b = sb.spec_drafted / max(1, sb.requests)
    drafted_a = sa.spec_drafted / max(1, sa.requests)
    return Finding(
        "spec_collapse", "speculative acceptance collapsed", drop / ACCEPTANCE_DROP, "tpot",
        f"speculative acceptance collapsed {pct(acc_b)} -> {pct(acc_a)} (drafted tokens per "
        f"request {drafted_b:.0f} -> {drafted_a:.0f}), so verification passes yield fewer "
        f"tokens and the draft work is wasted",
        [f"acceptance {pct(acc_b)} -> {pct(acc_a)}",
         f"drafted/request {drafted_b:.1f} -> {drafted_a:.1f}"],
        {"acceptance": [acc_b, acc_a], "drafted_per_request": [drafted_b, drafted_a]})


def router_imbalance(b: Cohort, a: Cohort) -> Finding | None:
    """One worker took a much larger share of the requests than before."""
    wa, wb = a.summary.workers, b.summary.workers
    if len(wa) + len(wb) < 2 or not wa:
        return None
    hot = max(wa, key=lambda w: wa[w].request_share)
    share_a = wa[hot].request_share
    share_b = max((g.request_share for g in wb.values()), default=1.0)
    rise = share_a - share_b
    if rise <= 0:
        return None
    n_workers = max(len(wa), len(wb))
    q_b = max((g.queue.p95 or 0 for g in wb.values()), default=None)
    return Finding(
        "router_imbalance", "router imbalance across workers", rise / WORKER_SHARE_RISE,
        "ttft",
        f"the router sent {pct(share_a)} of the requests to worker {hot} (the busiest worker "
        f"had {pct(share_b)} before, of {n_workers} workers), so its queue grew (p95 queue "
        f"{ms(q_b)} -> {ms(wa[hot].queue.p95)}) while the others idled",
        [f"worker {w}: {pct(g.request_share)} of requests" for w, g in wa.items()],
        {"hot_worker": hot, "busiest_share": [share_b, share_a],
         "shares_after": {w: g.request_share for w, g in wa.items()},
         "shares_before": {w: g.request_share for w, g in wb.items()}},
        explains=("kv_pressure", "prefill_interference"))


def compute_slowdown(b: Cohort, a: Cohort) -> Finding | None:
    """The same work took longer: prefill per token and decode gaps both slowed."""
    def per_token(c: Cohort):
        return percentile([s.phases["prefill"] / s.prefill_tokens for s in c.samples
                           if s.ok and "prefill" in s.phases and s.prefill_tokens > 0], 50)

    def gap(c: Cohort):
        return percentile([s.decode_mean_gap for s in c.samples
                           if s.ok and s.decode_mean_gap is not None], 50)
    pb, pa, gb, ga = per_token(b), per_token(a), gap(b), gap(a)
    if not (pb and pa and gb and ga) or pa <= pb or ga <= gb:
        return None
    score = min(pa / pb, ga / gb) / SLOWDOWN
    return Finding(
        "compute_slowdown", "the same work ran slower (compute)", score, "tpot",
        f"the same work ran slower on the device: prefill time per token "
        f"{pb * 1e6:.0f} -> {pa * 1e6:.0f} us and the median decode gap {ms(gb)} -> {ms(ga)}, "
        f"with no change in batching, caching or preemption",
        [f"prefill per token {pb * 1e6:.0f} -> {pa * 1e6:.0f} us",
         f"decode gap p50 {ms(gb)} -> {ms(ga)}"],
        {"prefill_s_per_token_p50": [pb, pa], "decode_gap_p50": [gb, ga]})


MECHANISMS: tuple[Callable[[Cohort, Cohort], Finding | None], ...] = (
    prefix_cache, noisy_tenant, kv_pressure, prefill_interference, spec_collapse,
    router_imbalance, compute_slowdown)


def find_all(b: Cohort, a: Cohort) -> list[Finding]:
    out = []
    for mechanism in MECHANISMS:
        f = mechanism(b, a)
        if f is not None:
            out.append(f)
    return out


def rank(findings: list[Finding]) -> list[Finding]:
    """Significant findings first: causes (not explained by another significant finding)
    by score, then their consequences by score; then the insignificant ones."""
    sig = [f for f in findings if f.significant]
    explained = {name for f in sig for name in f.explains}
    roots = sorted((f for f in sig if f.name not in explained), key=lambda f: -f.score)
    if not roots and sig:                     # a cycle of explanations: fall back to score
        roots = sorted(sig, key=lambda f: -f.score)
    rest = sorted((f for f in sig if f not in roots), key=lambda f: -f.score)
    weak = sorted((f for f in findings if not f.significant), key=lambda f: -f.score)
    return roots + rest + weak


__all__ = ["Cohort", "Dist", "Finding", "MECHANISMS", "find_all", "rank", "ms", "pct"]
