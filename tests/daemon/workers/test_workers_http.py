"""`tokenloom serve --workers 2` as a real process (tiny model): routing, parity, admin,
supervision. One server for the module; the kill test runs last (it restarts a worker).

The routed-prefix TTL is set to a millisecond, so the router's expected overlap can only come
from the workers' KV events (not from its memory of where it sent a prompt).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from client import admin as admin_command
from client import get, metrics, parse_sse, post
from servers import ServerProcess, wait_for

BLOCK = 8
MODEL = ""   # the served model name (the model directory's), set by the fixture
PREFIX = " ".join(f"w{10 + (i * 7) % 200}" for i in range(8 * BLOCK))   # 8 full blocks


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers")
    admin = str(tmp / "admin.sock")
    s = ServerProcess(
        "--workers", "2", "--model", str(tiny_model_dir),
        "--set", "model.device=cpu", "--set", "model.dtype=float32",
        "--set", f"model.cache_dir={tmp / 'cache'}", "--set", f"cache.block_size={BLOCK}",
        "--set", "cache.num_blocks=512", "--set", f"admin.socket_path={admin}",
        "--set", "workers.routed_prefix_ttl_seconds=0.001",
        "--set", "workers.restart_backoff_seconds=0.1", timeout=180)
    s.admin = admin
    global MODEL
    MODEL = tiny_model_dir.name
    yield s
    assert s.stop() == 0
    lines = s.json_lines()
    assert not [line for line in lines if line.get("event") == "worker supervision failed"]


def completion(url, body: dict) -> dict:
    status, reply = post(url, "/v1/completions", body)
    assert status == 200, reply
    return reply


def complete(url, prompt, max_tokens=8, **extra):
    return completion(url, {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, **extra})


def admin(server, cmd: dict) -> dict:
    return admin_command(server.admin, cmd)


def trace(server, rid):
    status, t = get(server, f"/v1/requests/{rid}/trace")
    assert status == 200, t
    return t


def test_ready_and_health_count_the_workers(cluster):
    assert get(cluster, "/ready") == (200, {"status": "ready", "workers_up": 2, "workers": 2})
    status, health = get(cluster, "/health")
    assert status == 200 and health["status"] == "ok"
    assert [(w["worker"], w["up"], w["threads"]) for w in health["workers"]] == [
        (0, True, 1), (1, True, 1)]
    assert len({w["pid"] for w in health["workers"]} | {cluster.proc.pid}) == 3


def test_greedy_output_matches_one_engine(cluster, server):
    """Token for token what the in-process engine (`server`: --workers 1) answers, for
    requests spread over both workers."""
    prompts = [" ".join(f"w{3 + (i * j) % 250}" for j in range(5 + i)) for i in range(6)]
    for p in prompts:
        a = complete(cluster.url, p, max_tokens=12)["choices"][0]["text"]
        b = complete(server.url, p, max_tokens=12)["choices"][0]["text"]
        assert a == b, p


def test_render_and_gateway_metrics_with_workers(cluster):
    """The render endpoints answer from the front (the ids a prompt runs with on any
    worker); the gateway's series are the daemon's as a whole: one cache_config_info with
    the pool's blocks, KV usage a 0-1 fraction."""
    status, rendered = post(cluster, "/v1/completions/render", {"prompt": "w5 w6 w7"})
    assert status == 200 and [r["token_ids"] for r in rendered] == [[5, 6, 7]], rendered
    status, rendered = post(cluster, "/v1/chat/completions/render", {
        "model": MODEL, "messages": [{"role": "user", "content": "w8 w9"}]})
    assert status == 200 and rendered["token_ids"][:2] == [8, 9], rendered
    reply = completion(cluster.url, {"prompt": rendered["token_ids"], "max_tokens": 2})
    assert reply["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    text = metrics(cluster)
    (info,) = [x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")]
    assert 'num_gpu_blocks="1024"' in info and f'block_size="{BLOCK}"' in info   # 2 x 512
    (usage,) = [x for x in text.splitlines() if x.startswith("vllm:kv_cache_usage_perc{")]
    assert 0.0 <= float(usage.rsplit(" ", 1)[1]) <= 1.0
    assert "# TYPE vllm:request_prefill_time_seconds histogram" in text


def test_routing_follows_the_prefix_from_kv_events(cluster):
    """1. a long prompt runs on some worker; its KV events say which blocks it holds
    2. prompts sharing that prefix go to the same worker, expecting the 8 blocks, and hit
    3. the trace records the decision."""
    first = completion(cluster, {"model": MODEL, "prompt": PREFIX + " w3", "max_tokens": 2,
                                 "temperature": 0})
    home = trace(cluster, first["id"])["routing"]["worker"]
    time.sleep(0.3)   # the KV events of its blocks reach the front
    for i in range(4):
        out = completion(cluster, {"model": MODEL, "prompt": f"{PREFIX} w{40 + i} w{50 + i}",
                                   "max_tokens": 2, "temperature": 0})
        routing = trace(cluster, out["id"])["routing"]
        assert routing["worker"] == home, routing
        assert routing["reason"] == "prefix" and routing["expected_hit_blocks"] == 8, routing
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
    text = metrics(cluster)
    expected = {line.split('worker="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("tokenloom:worker_expected_hit_blocks_total{")}
    assert expected[str(home)] >= 4 * 8 and set(expected) == {"0", "1"}
    assert "tokenloom:worker_prefix_cache_hit_rate{" in text


def test_siblings_share_a_worker_and_the_trace_has_every_choice(cluster):
    out = completion(cluster, {"model": MODEL, "prompt": ["w5 w6 w7", "w8 w9 w10"], "n": 2,
                               "max_tokens": 4, "temperature": 0})
    assert len(out["choices"]) == 4
    choices = trace(cluster, out["id"])["choices"]
    assert len(choices) == 4
    routing = [c["routing"] for c in choices]
    assert routing[0]["worker"] == routing[1]["worker"] and routing[1]["reason"] == "sibling"
    assert routing[2]["worker"] == routing[3]["worker"] and routing[3]["reason"] == "sibling"


def test_affinity_key_breaks_ties(cluster):
    """Short prompts (no full block: no overlap anywhere) on idle workers tie; the same
    prompt_cache_key (or X-Session-Id header) keeps them on one worker."""
    for body_key, header in (({"prompt_cache_key": "conversation-1"}, {}),
                             ({}, {"X-Session-Id": "session-7"})):
        workers = []
        for i in range(4):
            status, reply = post(cluster, "/v1/completions",
                                 {"model": MODEL, "prompt": f"w{90 + i}", "max_tokens": 2,
                                  "temperature": 0, **body_key}, headers=header)
            assert status == 200, reply
            routing = trace(cluster, reply["id"])["routing"]
            workers.append(routing["worker"])
            if i:
                assert routing["reason"] == "affinity", routing
        assert len(set(workers)) == 1


def test_admin_reaches_every_worker(cluster):
    stats = admin(cluster, {"cmd": "stats"})
    assert [w["worker"] for w in stats["workers"]] == [0, 1]
    assert all(w["up"] and w["pid"] for w in stats["workers"])
    assert sum(w["routed"] for w in stats["workers"]) >= 10
    assert admin(cluster, {"cmd": "flush-cache"})["freed"] > 0
    admin(cluster, {"cmd": "drain"})
    assert wait_for(lambda: all(w["draining"] for w in get(cluster, "/health")[1]["workers"]))
    assert get(cluster, "/ready")[0] == 503
    admin(cluster, {"cmd": "resume"})
    assert wait_for(lambda: not any(w["draining"]
                                    for w in get(cluster, "/health")[1]["workers"]))
    assert complete(cluster.url, "w5 w6")["choices"][0]["finish_reason"] == "length"
    # Nothing in flight: no KV block is held by a request on either worker.
    assert wait_for(lambda: admin(cluster, {"cmd": "stats"})["engine"]["kv"]["used"] == 0)


def test_killed_worker_ends_its_streams_and_restarts(cluster):
    """1. a stream runs on each worker  2. SIGKILL worker 0  3. its stream ends with an error
    event and [DONE] within 5 s, the other finishes  4. /health says degraded, /ready 1/2
    5. it restarts and serves again."""
    import threading

    results = {}

    def stream(i):
        req = urllib.request.Request(cluster.url + "/v1/completions", data=json.dumps({
            "model": MODEL, "prompt": f"w{60 + i} w{70 + i}", "max_tokens": 1500,
            "ignore_eos": True, "temperature": 0, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            results[i] = (r.read(), time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    pid = get(cluster, "/health")[1]["workers"][0]["pid"]
    assert wait_for(lambda: get(cluster, "/health")[1]["workers"][0]["kv_usage"], 10)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    events = [parse_sse(results[i][0]) for i in range(2)]
    failed = [e for e in events if any(isinstance(x, dict) and "error" in x for x in e)]
    assert len(failed) == 1, "exactly the killed worker's stream fails"
    assert "engine worker 0 died" in failed[0][-2]["error"]["message"]
    ended = min(results[i][1] for i in range(2) if events[i] is failed[0])
    assert ended - killed < 5.0
    status, health = get(cluster, "/health")
    w0 = health["workers"][0]
    if not w0["up"]:   # (it may already be back on a fast machine)
        assert status == 200 and health["status"] == "degraded"
        assert w0["last_exit_code"] == -signal.SIGKILL
        assert get(cluster, "/ready")[1]["workers_up"] == 1
    assert wait_for(lambda: get(cluster, "/ready")[1].get("workers_up") == 2, 60)
    health = get(cluster, "/health")[1]
    assert health["workers"][0]["restarts"] == 1 and health["workers"][0]["pid"] != pid
    for i in range(4):   # both workers serve (the restarted one is idle: it gets some)
        complete(cluster.url, f"w{80 + i}")
    stats = admin(cluster, {"cmd": "stats"})
    assert wait_for(lambda: admin(cluster, {"cmd": "stats"})["engine"]["kv"]["used"] == 0)
    assert stats["workers"][0]["routed"] >= 1
