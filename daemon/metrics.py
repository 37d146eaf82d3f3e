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
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets, to the
    context window)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# Per-request histograms, vLLM's names: key -> (name, help, buckets; "tokens" = 1-2-5 up to
# the context window). `request_observations` gives each key's values for one finished
# request; a new histogram is one row here and one line there.
REQUEST_HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "itl": ("vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "tpot": ("vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS),
    "e2e": ("vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS),
    "queue": ("vllm:request_queue_time_seconds",
              "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS),
    "inference": ("vllm:request_inference_time_seconds",
                  "Histogram of time spent in RUNNING phase for request.", LATENCY_BUCKETS),
    "prefill": ("vllm:request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS),
    "decode": ("vllm:request_decode_time_seconds",
               "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS),
    "prompt_tokens": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                      "tokens"),
    "generation_tokens": ("vllm:request_generation_tokens",
                          "Number of generation tokens processed.", "tokens"),
    "computed_tokens": ("vllm:request_prefill_kv_computed_tokens",
                        "Histogram of new KV tokens computed during prefill (excluding "
                        "cached tokens).", "tokens"),
    "max_tokens": ("vllm:request_params_max_tokens",
                   "Histogram of the max_tokens request parameter.", "tokens"),
    # Per prompt (its n choices together), when all of them have finished.
    "n": ("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
    "max_generated": ("vllm:request_max_num_generation_tokens",
                      "Histogram of maximum number of requested generation tokens.", "tokens"),
}


def request_observations(num_prompt_tokens: int, num_output_tokens: int, max_tokens: int,
                         t: RequestTimings | None) -> Iterator[tuple[str, float]]:
    """(REQUEST_HISTOGRAMS key, value) for one finished engine request. Phases as vLLM
    splits them: queued (arrival -> first scheduled), prefill (first scheduled -> first
    token), decode (first -> last token), inference (first scheduled -> last token)."""
    yield "prompt_tokens", num_prompt_tokens
    yield "generation_tokens", num_output_tokens
    yield "max_tokens", max_tokens
    if t is None:
        return
    yield "computed_tokens", max(num_prompt_tokens - t.num_cached_tokens, 0)
    times = t.token_times
    if t.first_scheduled is not None:
        yield "queue", t.first_scheduled - t.arrival
        if t.first_token is not None:
            yield "prefill", t.first_token - t.first_scheduled
        if times:
            yield "inference", times[-1] - t.first_scheduled
    if t.first_token is not None:
        yield "ttft", t.first_token - t.arrival
    for a, b in zip(times, times[1:]):
        yield "itl", b - a
    if times:
        yield "decode", times[-1] - times[0]
        if len(times) > 1:
            yield "tpot", (times[-1] - times[0]) / (len(times) - 1)
    if t.finished is not None:
        yield "e2e", t.finished - t.arrival


def cache_config_labels(cache) -> dict[str, str]:
    """vllm:cache_config_info's labels that come from the configuration (config.cache), in
    vLLM's spelling: Python reprs, swap space in GiB, the block-count override "None" when
    the count is derived from the memory budget; cache_dtype as cache.kv_dtype ("int8",
    "fp8_e4m3"... , "fp8_e4m3/int8" when K and V differ)."""
    from tokenloom.kernels.kv_quant import kv_dtype_name

    return {"cache_dtype": kv_dtype_name(cache),
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization),
            "num_gpu_blocks_override": str(cache.num_blocks or None),
            "swap_space": str(cache.swap_space_bytes / (1 << 30))}


class _EngineCollector:
    """Gauges and counters whose source of truth is an actor; values from the last refresh.

    Table-driven: every field of the typed EngineStats annotated with a Metric
    (actors/metric_fields.py) is exported as declared; only the series derived from several
    fields (or from configuration) are written out below."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None
        self.cache_config: dict[str, str] = {}   # cache_config_info labels from the config
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
        # affinity filter reads lora_requests_info (max_lora 0 when [lora] is off).
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's earlier name of "
                    "vllm:kv_cache_usage_perc). 1 means 100 percent usage.", kv.usage)
        # vLLM's labels where we hold the value (CacheConfig.metrics_info() + engine).
        config = dict(self.cache_config, block_size=str(kv.block_size),
                      num_gpu_blocks=str(kv.num_blocks), engine="0")
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=labels + sorted(config))
        info.add_metric(value + [config[k] for k in sorted(config)], 1.0)
        yield info
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests "
                                 "(the value is the time of the last update).",
                                 labels=labels + ["max_lora", "running_lora_adapters",
                                                  "waiting_lora_adapters"])
        ls = sched.lora
        if ls is None:
            lora.add_metric(value + ["0", "", ""], self.updated_at)
        else:
            lora.add_metric(value + [str(ls.max_loras), ",".join(ls.running),
                                     ",".join(ls.waiting)], self.updated_at)
        yield lora
        if ls is not None:
            by_adapter = CounterMetricFamily("tokenloom:lora_requests", "Requests that named "
                                             "each LoRA adapter.", labels=labels + ["lora_name"])
            for name, n in sorted(ls.requests_by_adapter.items()):
                by_adapter.add_metric(value + [name], n)
            yield by_adapter
            resident = GaugeMetricFamily("tokenloom:lora_resident_info", "1 for each LoRA "
                                         "adapter in a device slot now.",
                                         labels=labels + ["lora_name"])
            for name in ls.resident:
                if name:
                    resident.add_metric(value + [name], 1.0)
            yield resident
        dtype = GaugeMetricFamily("tokenloom:kv_cache_dtype_info",
                                  "How the KV cache stores K and V (cache.kv_dtype: auto = the "
                                  "model dtype; else the 1-byte format, K/V when they differ).",
                                  labels=labels + ["kv_dtype"])
        dtype.add_metric(value + [s.kv_quant.kv_dtype], 1.0)
        yield dtype
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
        if kv.tiers is not None:
            yield from tier_families(kv.tiers, labels, value)


def tier_families(t, labels: list[str], value: list[str]):
    """The KV tiers (docs/kv-tiers.md): per tier hit/query counters, usage, health, and
    bytes and seconds per transfer direction under vLLM's offloading names
    (`vllm:kv_offload_total_bytes` / `_total_time`, by `transfer_type` such as
    GPU_to_CPU), plus the planner's regret histogram and calibration errors."""
    def family(kind, name, doc, extra=()):
        return kind(name, doc, labels=labels + list(extra))

    queries = family(CounterMetricFamily, "tokenloom:kv_tier_queries",
                     "Blocks looked up in a KV tier (after the device's hits).", ["tier"])
    hits = family(CounterMetricFamily, "tokenloom:kv_tier_hits",
                  "Blocks restored from a KV tier into the device pool.", ["tier"])
    stored = family(CounterMetricFamily, "tokenloom:kv_tier_stored_blocks",
                    "Blocks written to a KV tier.", ["tier"])
    evicted = family(CounterMetricFamily, "tokenloom:kv_tier_evicted_blocks",
                     "Blocks a KV tier evicted for room.", ["tier"])
    dropped = family(CounterMetricFamily, "tokenloom:kv_tier_dropped_writes",
                     "Writes refused because the tier's write queue was full.", ["tier"])
    failed = family(CounterMetricFamily, "tokenloom:kv_tier_failed_reads",
                    "Reads that failed (corrupt, missing, unreachable): recomputed.", ["tier"])
    used = family(GaugeMetricFamily, "tokenloom:kv_tier_usage_bytes",
                  "Bytes a KV tier holds (remote: written by this daemon).", ["tier"])
    capacity = family(GaugeMetricFamily, "tokenloom:kv_tier_capacity_bytes",
                      "A KV tier's byte budget (0: bounded by the server).", ["tier"])
    blocks = family(GaugeMetricFamily, "tokenloom:kv_tier_blocks", "Blocks a KV tier holds.",
                    ["tier"])
    degraded = family(GaugeMetricFamily, "tokenloom:kv_tier_degraded",
                      "1 while a KV tier's medium is failing (falls back to recompute).",
                      ["tier"])
    nbytes = family(CounterMetricFamily, "vllm:kv_offload_total_bytes",
                    "Bytes moved between the device pool and a KV tier.", ["transfer_type"])
    seconds = family(CounterMetricFamily, "vllm:kv_offload_total_time",
                     "Seconds spent moving KV between the device pool and a KV tier.",
                     ["transfer_type"])
    for tier in t.tiers:
        c, lab = tier.counters, value + [tier.name]
        queries.add_metric(lab, c.queries)
        hits.add_metric(lab, c.hits)
        stored.add_metric(lab, c.stored_blocks)
        evicted.add_metric(lab, c.evicted_blocks)
        dropped.add_metric(lab, c.dropped_writes)
        failed.add_metric(lab, c.failed_reads)
        used.add_metric(lab, tier.bytes_used)
        capacity.add_metric(lab, tier.bytes_capacity)
        blocks.add_metric(lab, tier.num_blocks)
        degraded.add_metric(lab, 1.0 if tier.degraded else 0.0)
        down, up = f"GPU_to_{tier.medium}", f"{tier.medium}_to_GPU"
        nbytes.add_metric(value + [down], c.bytes_from_device)
        nbytes.add_metric(value + [up], c.bytes_to_device)
        seconds.add_metric(value + [down], c.seconds_from_device)
        seconds.add_metric(value + [up], c.seconds_to_device)
    yield from (queries, hits, stored, evicted, dropped, failed, used, capacity, blocks,
                degraded, nbytes, seconds)
    regret = HistogramMetricFamily(
        "tokenloom:kv_tier_regret_seconds", "Restore decisions: actual time to the end of "
        "the prefill minus the better alternative's prediction (<= 0: the choice was right).",
        labels=labels)
    regret.add_metric(value, [*((str(b), n) for b, n in zip(t.regret_buckets,
                                                           t.regret_counts)),
                              ("+Inf", t.regret_count)], sum_value=t.regret_sum)
    yield regret
    for name, v in (("restore", t.restore_error_median), ("recompute",
                                                           t.recompute_error_median)):
        g = GaugeMetricFamily(f"tokenloom:kv_tier_{name}_prediction_error",
                              f"Median relative error of the planner's {name} time "
                              "predictions (recent operations; -1 before any).", labels=labels)
        g.add_metric(value, -1.0 if v is None else v)
        yield g


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
    def __init__(self, model_name: str, max_model_len: int = 8192):
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
        self.cached_tokens = Counter("vllm:prompt_tokens_cached", "Number of cached prompt "
                                     "tokens (local prefix cache).", m,
                                     registry=r).labels(model_name)
        self.request_success = Counter("vllm:request_success",
                                       "Count of successfully processed requests.",
                                       m + ["finished_reason"], registry=r)
        tokens = buckets_1_2_5(max_model_len)
        self.histograms = {
            key: Histogram(name, doc, m, registry=r,
                           buckets=tokens if buckets == "tokens" else buckets).labels(model_name)
            for key, (name, doc, buckets) in REQUEST_HISTOGRAMS.items()}
        self.aborted = Counter("tokenloom:requests_aborted",
                               "Requests aborted because the client went away.", m,
                               registry=r).labels(model_name)
        self.http = Counter("tokenloom:http_requests", "HTTP requests by endpoint and status.",
                            ["endpoint", "status"], registry=r)

    def observe_finished(self, num_prompt_tokens: int, num_output_tokens: int,
                         finish_reason: str | None, t: RequestTimings | None,
                         max_tokens: int = 0) -> None:
        """One engine request ended (stop, length, stop string or abort); `max_tokens` is
        its max_tokens parameter."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if t is not None:
            self.cached_tokens.inc(t.num_cached_tokens)
        if finish_reason in ("stop", "length", "abort"):
            self.request_success.labels(self.model_name, finish_reason).inc()
        for key, value in request_observations(num_prompt_tokens, num_output_tokens,
                                               max_tokens, t):
            self.histograms[key].observe(value)

    def observe_prompt_done(self, n: int, max_generated: int) -> None:
        """All `n` choices of one prompt finished; the longest produced `max_generated`."""
        self.histograms["n"].observe(n)
        self.histograms["max_generated"].observe(max_generated)

    async def refresh(self, engine) -> None:
        """Read the actors' current state for the collector (at scrape time)."""
        self.engine.stats = await engine.stats()
        self.workers.snapshot = await engine.worker_stats()   # None in-process
        self.engine.cache_config = cache_config_labels(engine.config.cache)
        self.engine.updated_at = time.time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
