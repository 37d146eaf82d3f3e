"""The metrics an inference gateway's endpoint picker scrapes (Gateway API Inference
Extension model-server protocol, as llm-d uses it), with vLLM's names and semantics:
queue and running gauges, KV usage under both of vLLM's names, the cache geometry for the
prefix-cache scorer, and the LoRA info gauge (no adapters here)."""

from __future__ import annotations

import re
import time

from client import metrics, post


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
    """Graph/eager per step with the reason (on CPU, with compiled programs off as in tests, every step is eager),
    without waiting for the runner (its snapshot)."""
    status, reply = post(server, "/v1/completions",
                         {"model": model_name, "prompt": "w5 w6 w7", "max_tokens": 4})
    assert status == 200, reply
    deadline = time.monotonic() + 10
    while True:     # the runner refreshes its snapshot at most every 0.25 s
        text = metrics(server)
        found = re.search(r'^tokenloom:eager_steps_total\{.*reason="graphs.cpu_compile is off"\} ([0-9.e+]+)$',
                          text, re.M)
        if found and float(found.group(1)) > 0:
            break
        assert time.monotonic() < deadline, "eager steps never counted"
        time.sleep(0.3)
    assert re.search(r"^tokenloom:graph_steps_total\{.*\} 0\.0$", text, re.M)
