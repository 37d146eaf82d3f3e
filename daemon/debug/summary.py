"""One cohort's figures (`Summary`): what the before/after table of `tokenloom diagnose`
shows, computed from its `Sample`s and the replay's `/metrics` scrape. Pure module.

Latencies are seconds; percentiles interpolate linearly between order statistics (numpy's
default), so a p95 of 20 samples is between the 19th and 20th values.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Iterable, Sequence

from tokenloom.daemon.debug.samples import PHASES, Sample


def percentile(values: Sequence[float], q: float) -> float | None:
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: Iterable[float]) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


@dataclasses.dataclass
class Dist:
    p50: float | None
    p95: float | None
    mean: float | None
    n: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> "Dist":
        xs = [v for v in values if v is not None]
        return cls(percentile(xs, 50), percentile(xs, 95), mean(xs), len(xs))


@dataclasses.dataclass
class GroupSummary:
    """A tenant's or a worker's share of a cohort."""
    requests: int
    request_share: float
    prompt_token_share: float
    prompt_tokens_mean: float
    ttft: Dist
    queue: Dist


@dataclasses.dataclass
class Summary:
    requests: int
    errors: int
    ttft: Dist
    tpot: Dist
    itl: Dist                           # client-side gaps, or the trace's mean gap per request
    e2e: Dist
    phases: dict[str, Dist]
    prompt_tokens_mean: float
    prefill_tokens_mean: float
    hit_rate: float                     # cached / prompt tokens (token-weighted)
    first_miss_positions: list[int]     # per request: tokens served from the cache
    miss_reasons: dict[str, int]
    preemptions_per_request: float
    kv_refusals_per_request: float
    prefill_tokens_per_chunk: float | None
    decode_max_gap: Dist
    spec_drafted: int
    spec_accepted: int
    tenants: dict[str, GroupSummary]
    workers: dict[str, GroupSummary]
    server: dict[str, float]            # from the /metrics scrape (replays of tokenloom)

    @property
    def spec_acceptance(self) -> float | None:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else None


def _groups(samples: list[Sample], key) -> dict[str, GroupSummary]:
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        k = key(s)
        if k is not None:
            groups.setdefault(str(k), []).append(s)
    total_req = len(samples) or 1
    total_tok = sum(s.prompt_tokens for s in samples) or 1
    return {k: GroupSummary(len(g), len(g) / total_req,
                            sum(s.prompt_tokens for s in g) / total_tok,
                            sum(s.prompt_tokens for s in g) / len(g),
                            Dist.of(s.ttft for s in g),
                            Dist.of(s.phases.get("queue") for s in g))
            for k, g in sorted(groups.items())}


def server_figures(server: dict | None) -> dict[str, float]:
    """Deltas of the scraped counters over the replay and the sampled gauges: pool pressure,
    decode batch size, graph replay share, preemptions, 429s."""
    if not server:
        return {}
    before, after = server.get("before") or {}, server.get("after") or {}

    def delta(name: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if _is(k, name))

    out: dict[str, float] = {}
    samples = server.get("samples") or []
    usage = [s["kv_usage"] for s in samples if s.get("kv_usage") is not None]
    if usage:
        out["kv_usage_max"] = max(usage)
        out["kv_usage_mean"] = sum(usage) / len(usage)
    waiting = [s["waiting"] for s in samples if s.get("waiting") is not None]
    if waiting:
        out["waiting_mean"] = sum(waiting) / len(waiting)
    steps, total = 0.0, 0.0
    for k, v in after.items():
        if _is(k, "tokenloom:decode_batch_size"):
            size = _label(k, "size")
            n = v - before.get(k, 0.0)
            if size is not None and n > 0:
                steps += n
                total += n * float(size)
    if steps:
        out["decode_batch_size_mean"] = total / steps
    graph, eager = delta("tokenloom:graph_steps"), delta("tokenloom:eager_steps")
    if graph + eager > 0:
        out["graph_replay_share"] = graph / (graph + eager)
    for name, key in (("vllm:num_preemptions", "preemptions"),
                      ("tokenloom:requests_rejected_overload", "rejected_429"),
                      ("tokenloom:engine_steps", "engine_steps")):
        if any(_is(k, name) for k in after):
            out[key] = delta(name)
    return out


def _is(key: str, name: str) -> bool:
    """`key` (a scraped sample) is of the metric `name` (counters carry `_total`)."""
    base = key.split("{", 1)[0]
    return base == name or base == name + "_total"


def _label(key: str, name: str) -> str | None:
    inner = key[key.find("{") + 1:-1]
    for part in inner.split(","):
        k, _, v = part.partition("=")
        if k == name:
            return v.strip('"')
    return None


def summarize(samples: list[Sample], server: dict | None = None) -> Summary:
    ok = [s for s in samples if s.ok]
    n = len(ok) or 1
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    gaps: list[float] = []
    for s in ok:
        if s.itl:
            gaps.extend(s.itl)
        elif s.decode_mean_gap is not None:
            gaps.append(s.decode_mean_gap)
    chunks = sum(s.prefill_chunks for s in ok)
    chunked_tokens = sum(s.prefill_tokens for s in ok if s.prefill_chunks)
    return Summary(
        requests=len(samples), errors=len(samples) - len(ok),
        ttft=Dist.of(s.ttft for s in ok), tpot=Dist.of(s.tpot for s in ok),
        itl=Dist.of(gaps), e2e=Dist.of(s.e2e for s in ok),
        phases={p: Dist.of(s.phases.get(p) for s in ok) for p in PHASES
                if any(p in s.phases for s in ok)},
        prompt_tokens_mean=prompt / n, prefill_tokens_mean=(prompt - cached) / n,
        hit_rate=cached / prompt if prompt else 0.0,
        first_miss_positions=[s.cached_tokens for s in ok],
        miss_reasons=dict(Counter(s.miss_reason for s in ok if s.miss_reason)),
        preemptions_per_request=sum(s.preemptions for s in ok) / n,
        kv_refusals_per_request=sum(s.kv_refusals for s in ok) / n,
        prefill_tokens_per_chunk=chunked_tokens / chunks if chunks else None,
        decode_max_gap=Dist.of(s.decode_max_gap for s in ok),
        spec_drafted=sum(s.spec_drafted for s in ok),
        spec_accepted=sum(s.spec_accepted for s in ok),
        tenants=_groups(ok, lambda s: s.tenant),
        workers=_groups(ok, lambda s: s.worker),
        server=server_figures(server))
