"""/metrics is table-driven: every field of EngineStats annotated with a Metric
(actors/metric_fields.py) is exported under its declared name with its value, nested stats
included, without the collector naming it."""

from __future__ import annotations

import re

from tokenloom.actors.kv.prefix_cache import PrefixCacheStats
from tokenloom.actors.messages import (
    EngineStats,
    GraphStats,
    KVStats,
    RouterStats,
    SchedulerStats,
    SpecStats,
    StepTimings,
)
from tokenloom.actors.metric_fields import exported_fields
from tokenloom.daemon.metrics import Metrics


def _stats() -> EngineStats:
    sched = SchedulerStats(
        waiting=2, running=3, in_flight_steps=1, overlap=True, num_steps=41, num_forks=5,
        num_preemptions=4, num_swap_preemptions=1, num_free_blocks=70, max_decode_skip=2,
        admission_paused=True, prefill_budget=96, cost_model=None, swap_free_slots=None,
        num_slo_evaluated=9, num_slo_good=6, num_kv_plan_waits=7,
        timings=StepTimings(steps=10, forward_ms=12.5, host_ms=1.5, exposed_host_ms=0.25,
                            kv_round_trip_ms=0.125, batch_size=3.0),
        spec=SpecStats(method="ngram", num_speculative_tokens=3, num_drafts=8,
                       num_draft_tokens=24, num_accepted_tokens=11,
                       accepted_per_position=[6, 3, 2], steps_killed=1))
    kv = KVStats(num_blocks=100, free=70, used=30, usage=0.3, block_size=16, cached_blocks=12,
                 prefix_cache=PrefixCacheStats(queried_tokens=640, hit_tokens=320,
                                               missed_tokens={"cold": 300, "evicted": 20}))
    graphs = GraphStats(graph_steps=20, eager_steps=2, eager_reasons={"too big": 2},
                        decode_batch_size_histogram={"4": 19}, replays=20)
    return EngineStats(scheduler=sched, kv=kv, graphs=graphs,
                       router=RouterStats(in_flight=5, capacity=64, num_rejected=1))


def _value(text: str, name: str, labels: str = "") -> float:
    """The sample of `name` whose labels are model_name="m" plus `labels` (in any order)."""
    want = {'model_name="m"', *([labels] if labels else [])}
    for m in re.finditer(rf'^{re.escape(name)}(?:_total)?\{{(.*)\}} (\S+)$', text, re.M):
        if set(re.findall(r'\w+="[^"]*"', m.group(1))) == want:
            return float(m.group(2))
    raise AssertionError(f"{name}{{{labels}}} not exported")


def test_every_annotated_field_is_exported_with_its_value():
    metrics = Metrics("m")
    stats = _stats()
    metrics.engine.stats = stats
    text = metrics.render().decode()

    def walk(obj):
        for name, metric in exported_fields(type(obj)):
            v = getattr(obj, name)
            if isinstance(v, dict):
                for k, n in v.items():
                    assert _value(text, metric.name, f'{metric.label}="{k}"') == n
            elif isinstance(v, list):
                for i, n in enumerate(v):
                    assert _value(text, metric.name, f'{metric.label}="{i}"') == n
            elif metric.value:
                assert _value(text, metric.name, f'{metric.label}="{metric.value}"') == v
            else:
                assert _value(text, metric.name) == float(v), metric.name
        for name in obj.__struct_fields__:
            sub = getattr(obj, name)
            if hasattr(sub, "__struct_fields__"):
                walk(sub)

    walk(stats)
    # a counter added as one annotated field (actors/messages.py) and the line filling it
    assert _value(text, "tokenloom:kv_plan_waits") == 7
    # the series derived from several fields
    assert _value(text, "tokenloom:preemptions", 'mode="recompute"') == 3
    assert _value(text, "tokenloom:goodput_ratio") == 6 / 9
    assert _value(text, "tokenloom:prefill_chunk_budget_tokens") == 96


def test_a_missing_sub_struct_exports_nothing_of_it():
    metrics = Metrics("m")
    stats = _stats()
    import msgspec
    metrics.engine.stats = msgspec.structs.replace(
        stats, scheduler=msgspec.structs.replace(stats.scheduler, spec=None))
    text = metrics.render().decode()
    assert "vllm:spec_decode_num_drafts" not in text
    assert _value(text, "vllm:num_requests_running") == 3


def test_request_histograms_split_a_request_as_vllm_does():
    """Queue, prefill, decode and inference phases, TPOT and the token counts of one
    finished request (daemon/metrics.request_observations)."""
    from tokenloom.actors.messages import RequestTimings
    from tokenloom.daemon.metrics import buckets_1_2_5, request_observations

    t = RequestTimings(arrival=10.0, first_scheduled=10.5, first_token=11.0, finished=12.5,
                       token_times=[11.0, 11.5, 12.5], num_cached_tokens=16)
    obs: dict[str, list[float]] = {}
    for key, v in request_observations(40, 3, 8, t):
        obs.setdefault(key, []).append(v)
    assert obs == {"prompt_tokens": [40], "generation_tokens": [3], "max_tokens": [8],
                   "computed_tokens": [24], "queue": [0.5], "prefill": [0.5],
                   "inference": [2.0], "ttft": [1.0], "itl": [0.5, 1.0], "decode": [1.5],
                   "tpot": [0.75], "e2e": [2.5]}
    assert dict(request_observations(5, 0, 4, None)) == {"prompt_tokens": 5,
                                                        "generation_tokens": 0, "max_tokens": 4}
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048)[-1] == 2000


def test_cache_config_info_carries_vllm_labels():
    from tokenloom.config.schema import CacheConfig
    from tokenloom.daemon.metrics import cache_config_labels

    metrics = Metrics("m")
    metrics.engine.stats = _stats()
    metrics.engine.cache_config = cache_config_labels(CacheConfig(num_blocks=100))
    text = metrics.render().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels == {"model_name": "m", "block_size": "16", "num_gpu_blocks": "100",
                      "enable_prefix_caching": "True", "engine": "0",
                      "gpu_memory_utilization": "0.9", "num_gpu_blocks_override": "100",
                      "swap_space": "0.25", "cache_dtype": "auto"}
    assert line.endswith(" 1.0")
    quantized = cache_config_labels(CacheConfig(kv_dtype="int8", k_dtype="fp8_e4m3"))
    assert quantized["cache_dtype"] == "fp8_e4m3/int8"
