"""LoRA adapters with `tokenloom serve --workers 2` (tiny model, real processes):

1. one client's requests for an adapter, one after another, stay on the worker that holds
   it (the router prices a worker without it one block); concurrent ones spread over both
   workers, each with the same greedy output, which differs from the base model's;
2. an adapter loaded at run time is served by every worker (requests spread over both);
3. after a worker is killed and restarted, it serves the run-time adapter again (the pool
   restores it before the worker takes requests); /v1/models still lists it.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from client import get, post
from servers import ServerProcess, wait_for
from tinymodel import build_random_adapter

PROMPT = "w5 w6 w7 w8 w9 w10 w11 w12"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers-lora")
    sql = build_random_adapter(tiny_model_dir, tmp / "sql", rank=8, seed=1)
    chat = build_random_adapter(tiny_model_dir, tmp / "chat", rank=4, seed=2)
    s = ServerProcess(
        "--workers", "2", "--model", str(tiny_model_dir), "--lora-modules", f"sql={sql}",
        "--set", "model.device=cpu", "--set", "model.dtype=float32",
        "--set", f"model.cache_dir={tmp / 'cache'}", "--set", "cache.block_size=8",
        "--set", "cache.num_blocks=512", "--set", "lora.allow_runtime_updates=true",
        "--set", "workers.restart_backoff_seconds=0.1", timeout=180)
    s.chat = chat
    s.model = tiny_model_dir.name
    yield s
    assert s.stop() == 0


def complete(cluster, model, prompt=PROMPT):
    status, reply = post(cluster, "/v1/completions", {"model": model, "prompt": prompt,
                                                      "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True})
    assert status == 200, reply
    status, trace = get(cluster, f"/v1/requests/{reply['id']}/trace")
    return reply["choices"][0]["text"], trace["routing"]["worker"]


def concurrently(cluster, model, prompts):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(cluster, model, p), prompts))


def test_startup_adapter_on_both_workers(cluster):
    sequential = {complete(cluster, "sql", f"{PROMPT} w{100 + i}")[1] for i in range(4)}
    assert len(sequential) == 1, "sequential requests stay with the adapter's worker"
    prompts = [f"w{100 + i} {PROMPT}" for i in range(6)]   # distinct first blocks
    results = concurrently(cluster, "sql", prompts)
    assert {w for _, w in results} == {0, 1}
    for p, (text, _) in zip(prompts, results):   # the same answer from either worker
        assert complete(cluster, "sql", p)[0] == text
    base, _ = complete(cluster, cluster.model, prompts[0])
    assert base != results[0][0]


def test_runtime_adapter_survives_a_worker_restart(cluster):
    status, reply = post(cluster, "/v1/load_lora_adapter",
                         {"lora_name": "chat", "lora_path": str(cluster.chat)})
    assert status == 200, reply
    first = {w for _, w in concurrently(cluster, "chat", [f"w{150 + i} {PROMPT}"
                                                         for i in range(6)])}
    assert first == {0, 1}
    pid = get(cluster, "/health")[1]["workers"][1]["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: get(cluster, "/health")[1]["workers"][1]["pid"] != pid
                    and get(cluster, "/ready")[1].get("workers_up") == 2, 90)
    served = {w for _, w in concurrently(cluster, "chat", [f"w{200 + i} {PROMPT}"
                                                          for i in range(8)])}
    assert 1 in served, "the restarted worker must serve the run-time adapter"
    ids = {m["id"] for m in get(cluster, "/v1/models")[1]["data"]}
    assert {"sql", "chat"} <= ids
