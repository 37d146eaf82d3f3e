"""Per-worker Prometheus series (label worker="i") for /metrics with worker processes.

Read at scrape time like the engine's (`Metrics.refresh`): the pool's statuses, the router's
account and each live worker's own stats. The daemon-wide series (vllm:num_requests_running,
vllm:kv_cache_usage_perc, ...) stay the workers' sums, as one engine's would be.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


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
