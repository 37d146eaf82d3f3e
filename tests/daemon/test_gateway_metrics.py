"""The metrics an inference gateway's endpoint picker scrapes (Gateway API Inference
Extension model-server protocol, as llm-d uses it), with vLLM's names and semantics:
queue and running gauges, KV usage under both of vLLM's names, the cache geometry for the
prefix-cache scorer, and the LoRA info gauge (no adapters here)."""

from __future__ import annotations

import re
import time

import pytest

from client import metric, metrics, post


def test_endpoint_picker_metrics(server, model_name):
    before = time.time()
    text = metrics(server)
    m = f'model_name="{model_name}"'
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert re.search(rf"^{name}\{{{m}\}} [0-9.e+-]+$", text, re.M), name
    config = server.engine.config
    info = re.search(r'^vllm:cache_config_info\{(.*)\} 1\.0$', text, re.M)
    assert info, "vllm:cache_config_info missing"
    assert f'block_size="{config.cache.block_size}"' in info.group(1)
    assert f'num_gpu_blocks="{server.engine.info.num_blocks}"' in info.group(1)
    lora = re.search(r'^vllm:lora_requests_info\{(.*)\} ([0-9.e+]+)$', text, re.M)
    assert lora, "vllm:lora_requests_info missing"
    assert 'max_lora="0"' in lora.group(1) and 'running_lora_adapters=""' in lora.group(1)
    assert float(lora.group(2)) >= before - 1     # the time of the last update


def test_graph_dispatch_counters_are_exported(server, model_name):
    """Graph/eager per step with the reason (on CPU, with compiled programs off as in tests,
    every step is eager), without waiting for the runner (its snapshot)."""
    status, reply = post(server, "/v1/completions",
                         {"model": model_name, "prompt": "w5 w6 w7", "max_tokens": 4})
    assert status == 200, reply
    deadline = time.monotonic() + 10
    while True:     # the runner refreshes its snapshot at most every 0.25 s
        text = metrics(server)
        found = re.search(r'^tokenloom:eager_steps_total\{.*reason="graphs.cpu_compile is off"\} '
                          r'([0-9.e+]+)$', text, re.M)
        if found and float(found.group(1)) > 0:
            break
        assert time.monotonic() < deadline, "eager steps never counted"
        time.sleep(0.3)
    assert re.search(r"^tokenloom:graph_steps_total\{.*\} 0\.0$", text, re.M)


# The vLLM series inference-perf (0.7.0, client/modelserver/vllm_client.py) scrapes, with the
# type vLLM gives them; the ones not exported are listed, with why, in docs/operations.md.
INFERENCE_PERF = {
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram", "vllm:request_params_max_tokens": "histogram",
    "vllm:prompt_tokens_cached": "counter",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
}
NOT_EXPORTED = ("vllm:iteration_tokens_total", "vllm:external_prefix_cache_hits",
                "vllm:external_prefix_cache_queries", "vllm:mm_cache_hits",
                "vllm:mm_cache_queries", "vllm:corrupted_requests",
                "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_lifetime_seconds",
                "vllm:kv_block_reuse_gap_seconds")


def test_inference_perf_series_are_exported_with_vllm_types(server, model_name):
    """1. a request with n=2; 2. every series inference-perf reads is there with vLLM's type
    and a model_name label; 3. the histograms saw the request (per choice, per prompt)."""
    from pathlib import Path

    before = metrics(server)
    status, reply = post(server, "/v1/completions", {"model": model_name, "prompt": "w5 w6 w7",
                                                     "max_tokens": 4, "n": 2,
                                                     "ignore_eos": True})
    assert status == 200, reply
    text = metrics(server)
    for name, kind in INFERENCE_PERF.items():
        # The text format names a counter's family with its _total (prometheus_client, as
        # vLLM exposes it too).
        family = f"{name}_total" if kind == "counter" else name
        assert f"# TYPE {family} {kind}" in text, name
        sample = f"{name}_count" if kind == "histogram" else family
        assert re.search(rf'^{re.escape(sample)}\{{.*model_name="{model_name}"', text, re.M), name

    def grew(series: str) -> float:
        return metric(text, series, model_name=model_name) - \
            metric(before, series, model_name=model_name)

    assert grew("vllm:request_prompt_tokens_count") == 2         # one per choice
    assert grew("vllm:request_prompt_tokens_sum") == 6
    assert grew("vllm:request_generation_tokens_sum") == 8
    assert grew("vllm:request_params_max_tokens_sum") == 8
    assert grew("vllm:request_params_n_count") == 1              # one per prompt
    assert grew("vllm:request_params_n_sum") == 2
    assert grew("vllm:request_max_num_generation_tokens_sum") == 4
    assert grew("vllm:request_time_per_output_token_seconds_count") == 2
    # Token-count buckets are vLLM's 1-2-5 series up to the context window.
    les = re.findall(r'^vllm:request_prompt_tokens_bucket\{.*le="([0-9.]+)"', text, re.M)
    assert [float(x) for x in les][:4] == [1, 2, 5, 10]
    assert float(les[-1]) <= server.engine.info.max_model_len
    # What is not exported is documented, with the reason.
    doc = (Path(__file__).parents[2] / "docs" / "operations.md").read_text()
    for name in NOT_EXPORTED:
        assert name not in text and name in doc, name


def test_kv_cache_usage_is_a_fraction_of_the_pool(server, model_name):
    status, _ = post(server, "/v1/completions", {"model": model_name, "prompt": "w9 " * 40,
                                                 "max_tokens": 2})
    assert status == 200
    text = metrics(server)
    usage = metric(text, "vllm:kv_cache_usage_perc", model_name=model_name)
    used = metric(text, "tokenloom:kv_blocks_total") - metric(text, "tokenloom:kv_blocks_free")
    assert 0.0 <= usage <= 1.0
    assert usage == pytest.approx(used / metric(text, "tokenloom:kv_blocks_total"))
