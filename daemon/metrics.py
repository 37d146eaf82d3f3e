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

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenloom.actors.messages import EngineStats, RequestTimings

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
    """Gauges and counters whose source of truth is an actor; values from the last refresh."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None
        self.prefix_caching = False
        self.updated_at = 0.0   # Unix time of the last refresh

    def collect(self):
        s = self.stats
        if s is None:  # not scraped through refresh() yet
            return
        sched, kv, router, pc = s.scheduler, s.kv, s.router, s.kv.prefix_cache
        labels = ["model_name"]
        value = [self.model_name]

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(value, v)
            return g

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    sched.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    sched.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    kv.usage)
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
        yield counter("vllm:num_preemptions", "Cumulative number of preemptions.",
                      sched.num_preemptions)
        yield gauge("tokenloom:kv_blocks_total", "KV-cache blocks in the pool.", kv.num_blocks)
        yield gauge("tokenloom:kv_blocks_free", "KV-cache blocks free.", kv.free)
        yield counter("tokenloom:engine_steps", "Engine iterations (batches) executed.",
                      sched.num_steps)
        yield gauge("tokenloom:requests_in_flight",
                    "Requests admitted by the router and not yet finished.", router.in_flight)
        yield counter("tokenloom:requests_rejected_overload",
                      "Requests refused with 429 because the waiting queue was full.",
                      router.num_rejected)
        # Prefix cache: vLLM's token-based query/hit counters, plus misses by reason (a
        # preempted request's recompute is neither a query nor a hit, only a miss reason).
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      pc.queried_tokens)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", pc.hit_tokens)
        missed = CounterMetricFamily("tokenloom:prefix_cache_missed_tokens",
                                     "Prompt tokens not served from the prefix cache, by the "
                                     "reason of the request's first miss.",
                                     labels=labels + ["reason"])
        for reason, n in sorted(pc.missed_tokens.items()):
            missed.add_metric(value + [reason], n)
        yield missed
        yield gauge("tokenloom:prefix_cache_blocks", "KV blocks holding a cached prefix.",
                    kv.cached_blocks)
        # Scheduling promises (see docs/scheduling.md).
        by_mode = CounterMetricFamily("tokenloom:preemptions",
                                      "Preemptions by mode (recompute or swap).",
                                      labels=labels + ["mode"])
        swapped = sched.num_swap_preemptions
        by_mode.add_metric(value + ["recompute"], sched.num_preemptions - swapped)
        by_mode.add_metric(value + ["swap"], swapped)
        yield by_mode
        yield gauge("tokenloom:max_decode_skip",
                    "Most consecutive iterations any running decode was left out (invariant: "
                    "<= scheduler.max_decode_skip).", sched.max_decode_skip)
        budget = sched.prefill_budget
        yield gauge("tokenloom:prefill_chunk_budget_tokens",
                    "Prefill tokens the SLO chunker allowed in the last iteration (-1: the "
                    "static budget).", -1 if budget is None else budget)
        yield gauge("tokenloom:admission_paused",
                    "1 while admission waits for the KV resume watermark after a preemption.",
                    1 if sched.admission_paused else 0)
        evaluated, good = sched.num_slo_evaluated, sched.num_slo_good
        yield counter("tokenloom:slo_evaluated_requests",
                      "Finished requests checked against the TTFT and ITL objectives.", evaluated)
        yield counter("tokenloom:goodput_requests",
                      "Finished requests within the TTFT and ITL objectives.", good)
        yield gauge("tokenloom:goodput_ratio",
                    "Share of finished requests within their objectives (1 before any).",
                    good / evaluated if evaluated else 1.0)
        if sched.spec is not None:   # speculative decoding (vLLM's spec_decode counters)
            sp = sched.spec
            yield counter("vllm:spec_decode_num_drafts",
                          "Verification steps: one per speculating sequence per step.",
                          sp.num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                          sp.num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          sp.num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted draft tokens by position in the draft.",
                                          labels=labels + ["position"])
            for j in range(sp.num_speculative_tokens):
                n = sp.accepted_per_position[j] if j < len(sp.accepted_per_position) else 0
                per_pos.add_metric(value + [str(j)], n)
            yield per_pos
            yield counter("tokenloom:spec_decode_steps_killed",
                          "Steps where speculation would not pay for the batch (kill switch).",
                          sp.steps_killed)
        # Graph or eager, per step (graphs/dispatch.py), and replays counted where they run.
        g = s.graphs
        if g:
            yield counter("tokenloom:graph_steps", "Decode steps that replayed a CUDA graph.",
                          g.get("graph_steps", 0))
            eager = CounterMetricFamily("tokenloom:eager_steps", "Steps run eagerly, by reason.",
                                        labels=labels + ["reason"])
            for reason, n in sorted(g.get("eager_reasons", {}).items()):
                eager.add_metric(value + [reason], n)
            yield eager
            yield counter("tokenloom:graph_replays", "CUDA graph replays (counted at replay).",
                          g.get("replays", 0))
            yield counter("tokenloom:graph_padding_rows", "Padding rows computed by graph "
                          "replays (bucket size minus batch size).", g.get("graph_padded_rows", 0))
            yield gauge("tokenloom:graph_padding_waste_ratio", "Padding rows / all rows of "
                        "graph replays.", g.get("padding_waste_fraction", 0.0))
            yield counter("tokenloom:piecewise_steps", "Steps with prefill tokens that "
                          "replayed piecewise CUDA graphs (everything but attention).",
                          g.get("piecewise_steps", 0))
            yield counter("tokenloom:piecewise_replays", "Piecewise graph replays (counted "
                          "at replay; one per step).", g.get("piecewise_replays", 0))
            yield counter("tokenloom:piecewise_padding_tokens", "Padding tokens computed by "
                          "piecewise replays (token bucket minus step tokens).",
                          g.get("piecewise_padded_tokens", 0))
            sizes = CounterMetricFamily("tokenloom:decode_batch_size", "Decode-only steps by "
                                        "batch size (the histogram graphs.histogram_path wants).",
                                        labels=labels + ["size"])
            for size, n in g.get("decode_batch_size_histogram", {}).items():
                sizes.add_metric(value + [str(size)], n)
            yield sizes
        # Where a step's time goes (means over the last 256 steps), see docs/architecture.md,
        # "The engine loop".
        t = sched.timings
        step = GaugeMetricFamily("tokenloom:step_time_ms",
                                 "Mean engine step time by part over the last steps: forward "
                                 "(the runner), host (planning, KV round trip, output "
                                 "processing), exposed_host (host time the runner waited for).",
                                 labels=labels + ["part"])
        for part in ("forward", "host", "exposed_host", "kv_round_trip"):
            step.add_metric(value + [part], getattr(t, f"{part}_ms"))
        yield step


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
        if hasattr(engine, "worker_stats"):   # worker processes: per-worker series
            self.workers.snapshot = await engine.worker_stats()
        self.engine.prefix_caching = engine.config.cache.enable_prefix_caching
        self.engine.updated_at = time.time()

    def render(self) -> bytes:
        return generate_latest(self.registry)
