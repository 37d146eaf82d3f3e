"""Prometheus metrics, named and shaped like vLLM's so dashboards built for vLLM work unchanged.

Two sources:
- per-request observations (TTFT, ITL, end-to-end, queue time, token counts), made by the HTTP
  layer when a request finishes, from the timings the scheduler attaches to its last output;
- engine state (running/waiting, KV usage, preemptions, ...), read from the actors at scrape
  time (`refresh`) and exported by a collector, so there is no polling loop.

Every server owns its own registry (tests run several in one process).
"""

from __future__ import annotations

import time
from typing import Iterator

import msgspec
from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenloom.actors.messages import EngineStats, RequestTimings
from tokenloom.actors.metric_fields import Metric, exported_fields

# As vLLM does: no `_created` series next to every counter and histogram.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries, so histogram quantiles compare like for like.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters whose source of truth is an actor; values from the last refresh.

    Table-driven: every field of the typed EngineStats annotated with a Metric
    (actors/metric_fields.py) is exported as declared; only the series derived from several
    fields (or from configuration) are written out below."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None
        self.prefix_caching = False
        self.updated_at = 0.0   # Unix time of the last refresh

    def collect(self):
        s = self.stats
        if s is None:  # not scraped through refresh() yet
            return
        families: dict[str, object] = {}
        for metric, labels, v in _samples(s):
            family = families.get(metric.name)
            if family is None:
                kind = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
                family = families[metric.name] = kind(
                    metric.name, metric.doc, labels=["model_name", *labels])
            family.add_metric([self.model_name, *labels.values()], float(v))
        yield from families.values()
        yield from self._derived(s)

    def _derived(self, s: EngineStats):
        sched, kv = s.scheduler, s.kv
        labels, value = ["model_name"], [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        # The inference gateway's model-server protocol (Gateway API Inference Extension,
        # llm-d): older endpoint pickers read KV usage under vLLM's previous name; the
        # prefix-cache scorer reads the block geometry from cache_config_info; the LoRA
        # affinity filter reads lora_requests_info (no adapters are served here: max_lora 0).
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's earlier name of "
                    "vllm:kv_cache_usage_perc). 1 means 100 percent usage.", kv.usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache "
                                 "configuration (labels).",
                                 labels=labels + ["block_size", "num_gpu_blocks",
                                                  "enable_prefix_caching"])
        info.add_metric(value + [str(kv.block_size), str(kv.num_blocks),
                                 str(self.prefix_caching)], 1.0)
        yield info
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests "
                                 "(the value is the time of the last update).",
                                 labels=labels + ["max_lora", "running_lora_adapters",
                                                  "waiting_lora_adapters"])
        lora.add_metric(value + ["0", "", ""], self.updated_at)
        yield lora
        # Scheduling promises (see docs/scheduling.md).
        by_mode = CounterMetricFamily("tokenloom:preemptions",
                                      "Preemptions by mode (recompute or swap).",
                                      labels=labels + ["mode"])
        swapped = sched.num_swap_preemptions
        by_mode.add_metric(value + ["recompute"], sched.num_preemptions - swapped)
        by_mode.add_metric(value + ["swap"], swapped)
        yield by_mode
        budget = sched.prefill_budget
        yield gauge("tokenloom:prefill_chunk_budget_tokens",
                    "Prefill tokens the SLO chunker allowed in the last iteration (-1: the "
                    "static budget).", -1 if budget is None else budget)
        evaluated, good = sched.num_slo_evaluated, sched.num_slo_good
        yield gauge("tokenloom:goodput_ratio",
                    "Share of finished requests within their objectives (1 before any).",
                    good / evaluated if evaluated else 1.0)


def _samples(stats) -> Iterator[tuple[Metric, dict[str, str], float]]:
    """(metric, extra labels, value) for every exported field of `stats`, nested Structs
    included (a None sub-struct, e.g. speculation off, exports nothing)."""
    for name, metric in exported_fields(type(stats)):
        v = getattr(stats, name)
        if isinstance(v, dict):
            for key, n in sorted(v.items()):
                yield metric, {metric.label: str(key)}, n
        elif isinstance(v, list):
            for i, n in enumerate(v):
                yield metric, {metric.label: str(i)}, n
        else:
            yield metric, ({metric.label: metric.value} if metric.value else {}), v
    for name in stats.__struct_fields__:
        v = getattr(stats, name)
        if isinstance(v, msgspec.Struct):
            yield from _samples(v)


class Metrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        m = ["model_name"]
        self.engine = _EngineCollector(model_name)
        r.register(self.engine)
        from tokenloom.daemon.workers.metrics import WorkerCollector
        self.workers = WorkerCollector(model_name)   # worker processes only
        r.register(self.workers)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     m, registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", m,
                                         registry=r).labels(model_name)
        self.request_success = Counter("vllm:request_success",
                                       "Count of successfully processed requests.",
                                       m + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", m,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", m,
                             buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", m,
                             buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", m,
                                    buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.decode_time = Histogram("tokenloom:request_decode_time_seconds",
                                     "Histogram of first-to-last token time per request.", m,
                                     buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.aborted = Counter("tokenloom:requests_aborted",
                               "Requests aborted because the client went away.", m,
                               registry=r).labels(model_name)
        self.http = Counter("tokenloom:http_requests", "HTTP requests by endpoint and status.",
                            ["endpoint", "status"], registry=r)

    def observe_finished(self, num_prompt_tokens: int, num_output_tokens: int,
                         finish_reason: str | None, t: RequestTimings | None) -> None:
        """One engine request ended (stop, length, stop string or abort)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if finish_reason in ("stop", "length", "abort"):
            self.request_success.labels(self.model_name, finish_reason).inc()
        if t is None:
            return
        if t.first_scheduled is not None:
            self.queue_time.observe(t.first_scheduled - t.arrival)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
        times = t.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
        if times:
            self.decode_time.observe(times[-1] - times[0])
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)

    async def refresh(self, engine) -> None:
        """Read the actors' current state for the collector (at scrape time)."""
        self.engine.stats = await engine.stats()
        self.workers.snapshot = await engine.worker_stats()   # None in-process
        self.engine.prefix_caching = engine.config.cache.enable_prefix_caching
        self.engine.updated_at = time.time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
