"""Per-worker Prometheus series (label worker="i") for /metrics with worker processes.

Read at scrape time like the engine's (`Metrics.refresh`): the pool's statuses, the router's
account and each live worker's own stats. The daemon-wide series (vllm:num_requests_running,
vllm:kv_cache_usage_perc, ...) stay the workers' sums, as one engine's would be.
"""

from __future__ import annotations

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)


class WorkerCollector:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot = None   # WorkerStats, or None (the in-process engine)

    def collect(self):
        if self.snapshot is None:
            return
        snap = self.snapshot
        statuses, routing, stats = snap.statuses, snap.routing, snap.engines
        labels = ["model_name", "worker"]

        def family(kind, name, doc, values):
            f = kind(name, doc, labels=labels)
            for w, v in values:
                f.add_metric([self.model_name, str(w)], v)
            return f

        workers = [s.worker for s in statuses]
        G, C = GaugeMetricFamily, CounterMetricFamily
        yield family(G, "tokenloom:worker_up", "1 while the engine worker process serves.",
                     [(s.worker, float(s.up)) for s in statuses])
        yield family(C, "tokenloom:worker_restarts", "Times the worker was restarted after "
                     "dying.", [(s.worker, s.restarts) for s in statuses])
        yield family(G, "tokenloom:worker_requests_in_flight", "Requests routed to the "
                     "worker and not finished (the router's account).",
                     [(w, routing.in_flight[w]) for w in workers])
        yield family(G, "tokenloom:worker_queued_prefill_blocks", "Prompt blocks routed to "
                     "the worker and not yet prefilled (expected cached blocks excluded).",
                     [(w, routing.queued_prefill_blocks[w]) for w in workers])
        yield family(G, "tokenloom:worker_requests_decoding", "Requests past their first "
                     "token on the worker.", [(w, routing.decoding[w]) for w in workers])
        yield family(G, "tokenloom:worker_kv_cache_usage_perc", "The worker's KV-cache usage "
                     "(last report). 1 means 100 percent.",
                     [(w, routing.kv_usage[w]) for w in workers])
        yield family(C, "tokenloom:worker_routed_requests", "Requests routed to the worker.",
                     [(w, routing.routed[w]) for w in workers])
        yield family(C, "tokenloom:worker_routed_prompt_blocks", "Full prompt blocks of the "
                     "requests routed to the worker.",
                     [(w, routing.prompt_blocks[w]) for w in workers])
        yield family(C, "tokenloom:worker_expected_hit_blocks", "Prompt blocks the router "
                     "expected the worker to hold when it routed there.",
                     [(w, routing.expected_hit_blocks[w]) for w in workers])
        live = sorted(stats.items())
        yield family(C, "tokenloom:worker_prefix_cache_queries", "The worker's prefix cache "
                     "queries, in tokens (since its last start).",
                     [(w, s.kv.prefix_cache.queried_tokens) for w, s in live])
        yield family(C, "tokenloom:worker_prefix_cache_hits", "The worker's prefix cache "
                     "hits, in tokens (since its last start).",
                     [(w, s.kv.prefix_cache.hit_tokens) for w, s in live])
        yield family(G, "tokenloom:worker_prefix_cache_hit_rate", "hits / queries of the "
                     "worker's prefix cache since its last start.",
                     [(w, s.kv.prefix_cache.hit_rate) for w, s in live])
        if routing.disaggregation is not None:
            yield from self._disaggregation(routing.disaggregation)

    def _disaggregation(self, d: dict):
        """Disaggregation: decisions, handoffs by outcome and in flight, transfer histograms."""
        name = [self.model_name]
        f = CounterMetricFamily("tokenloom:disaggregation_decisions", "Requests by where "
                                "their prompt was prefilled: remote (a prefill worker, then a "
                                "KV handoff) or local (the decode worker), and why.",
                                labels=["model_name", "choice", "reason"])
        for key, n in sorted(d.get("decisions", {}).items()):
            choice, reason = key.split(":", 1)
            f.add_metric([*name, choice, reason], n)
        yield f
        h = d.get("handoffs") or {}
        f = CounterMetricFamily("tokenloom:handoffs", "Handoffs ended, by outcome (claimed: "
                                "the decode worker restored and produced a token; rehomed, "
                                "prefill_lost, prefill_failed, expired, aborted, failed).",
                                labels=["model_name", "outcome"])
        for outcome, n in sorted(h.get("outcomes", {}).items()):
            f.add_metric([*name, outcome], n)
        yield f
        f = GaugeMetricFamily("tokenloom:handoffs_in_flight", "Handoffs in flight, by state.",
                              labels=["model_name", "state"])
        for state in ("prefilling", "transferring", "decoding"):
            f.add_metric([*name, state], h.get("by_state", {}).get(state, 0))
        yield f
        yield GaugeMetricFamily("tokenloom:handoff_leased_blocks", "KV blocks held in the "
                                "handoff tier under a lease.", value=h.get("leased_blocks", 0))
        for key, metric, doc in (
                ("transfer_seconds", "tokenloom:handoff_transfer_seconds",
                 "A decode worker's restore of one handoff's blocks from the handoff tier."),
                ("transfer_bytes", "tokenloom:handoff_transfer_bytes",
                 "KV bytes one handoff moved to its decode worker.")):
            hist = h.get(key)
            if hist is None:
                continue
            cum, buckets = 0, []
            for bound, n in zip([*hist["bounds"], float("inf")], hist["counts"]):
                cum += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
            f = HistogramMetricFamily(metric, doc, labels=["model_name"])
            f.add_metric(name, buckets, hist["sum"])
            yield f
