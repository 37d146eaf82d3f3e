"""Disaggregated prefill and decode with `tokenloom serve --workers 3 --set workers.prefill=1`
(tiny model, real processes): worker 0 prefills, workers 1 and 2 decode.

1. every prompt long enough is prefilled on worker 0 and decoded on a decode worker, the
   greedy text equal to the in-process engine's (`server`), the decode side restoring the
   prompt from the handoff tier (trace: routing.prefill_worker, tiers restored from "peer");
2. /health, /ready, admin stats and /metrics show roles, handoffs and their outcomes;
3. a decode worker killed (SIGKILL) before it produced a token: its requests are re-homed to
   the other decode worker and complete with the same text;
4. the prefill worker killed mid-prefill: its requests are prefilled by their decode worker,
   same text;
after each test no handoff block is left in the handoff tier once leases are settled, and no
KV block is held on any worker.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tokenloom.actors.kv.tiers.handoff import stored_blocks

from client import admin as admin_command
from client import get, metrics, post
from servers import ServerProcess, wait_for

BLOCK = 8
MODEL = ""


def prompt(i: int, n: int = 40) -> str:
    return " ".join(f"w{3 + (i * 31 + j * 7) % 250}" for j in range(n))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers-disagg")
    admin = str(tmp / "admin.sock")
    s = ServerProcess(
        "--workers", "3", "--model", str(tiny_model_dir),
        "--set", "workers.prefill=1", "--set", "workers.disaggregation=always",
        "--set", "workers.min_remote_prefill_tokens=16",
        "--set", "model.device=cpu", "--set", "model.dtype=float32",
        "--set", f"model.cache_dir={tmp / 'cache'}", "--set", f"cache.block_size={BLOCK}",
        "--set", "cache.num_blocks=512", "--set", f"admin.socket_path={admin}",
        "--set", "workers.restart_backoff_seconds=0.1",
        "--set", "workers.handoff_lease_seconds=5", timeout=240)
    s.admin = admin
    global MODEL
    MODEL = tiny_model_dir.name
    yield s
    assert s.stop() == 0
    lines = s.json_lines()
    assert not [line for line in lines if line.get("event") == "worker supervision failed"]


def complete(url, text, max_tokens=10, **extra) -> dict:
    status, reply = post(url, "/v1/completions", {"model": MODEL, "prompt": text,
                                                  "max_tokens": max_tokens, "temperature": 0,
                                                  "ignore_eos": True, **extra})
    assert status == 200, reply
    return reply


def trace(cluster, rid) -> dict:
    status, t = get(cluster, f"/v1/requests/{rid}/trace")
    assert status == 200, t
    return t


def health(cluster) -> dict:
    return get(cluster, "/health")[1]


def settled(cluster) -> None:
    """No handoff in flight, no block file left, no KV block held on any worker."""
    h = health(cluster)["handoffs"]
    assert wait_for(lambda: health(cluster)["handoffs"]["in_flight"] == 0, 20), h
    assert wait_for(lambda: stored_blocks(h["dir"]) == [], 10), stored_blocks(h["dir"])
    def idle():
        reply = admin_command(cluster.admin, {"cmd": "stats"})
        assert "engine" in reply, reply
        return reply["engine"]["kv"]["used"] == 0
    assert wait_for(idle, 20)


def test_handoff_output_equals_one_engine(cluster, server):
    for i in range(4):
        text = prompt(i, 30 + 5 * i)
        reply = complete(cluster.url, text)
        want = complete(server.url, text)["choices"][0]["text"]
        assert reply["choices"][0]["text"] == want, text
        t = trace(cluster, reply["id"])
        routing = t["routing"]
        assert routing["prefill_worker"] == 0 and routing["worker"] in (1, 2), routing
        assert routing["disaggregation"]["remote_prefill"] is True
        tiers = t.get("kv_tiers") or {}
        assert "peer" in str(tiers.get("plan")), t
    # A short prompt stays where it decodes (below min_remote_prefill_tokens).
    reply = complete(cluster.url, "w5 w6 w7")
    routing = trace(cluster, reply["id"])["routing"]
    assert routing["prefill_worker"] is None or "prefill_worker" not in routing
    assert routing["disaggregation"]["reason"] == "short_prompt"
    settled(cluster)


def test_roles_in_health_ready_admin_and_metrics(cluster):
    h = health(cluster)
    assert [w["role"] for w in h["workers"]] == ["prefill", "decode", "decode"]
    assert h["handoffs"]["outcomes"].get("claimed", 0) >= 4
    assert h["handoffs"]["bytes_transferred"] > 0
    status, ready = get(cluster, "/ready")
    assert status == 200 and ready["roles_up"] == {"decode": 2, "prefill": 1}, ready
    stats = admin_command(cluster.admin, {"cmd": "stats"})
    assert [w["role"] for w in stats["workers"]] == ["prefill", "decode", "decode"]
    # The cost model's rates: a decode rate from the requests' token times (sampled after
    # a few tokens and again when each ends) and the arrivals behind the duty forecast.
    d = stats["disaggregation"]
    assert d["decode_samples"] >= 8 and d["decode_ms_per_token"] > 0, d
    assert 0 <= d["prefill_duty_forecast"] <= 1, d
    text = metrics(cluster)
    assert 'tokenloom:disaggregation_decisions_total{' in text
    assert "tokenloom:handoff_transfer_seconds_bucket" in text
    assert "tokenloom:handoff_transfer_bytes_bucket" in text
    assert 'tokenloom:handoffs_total{' in text and 'outcome="claimed"' in text


def _concurrently(cluster, texts):
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(lambda t: complete(cluster.url, t), texts))


def test_decode_worker_killed_before_its_first_token(cluster, server):
    """Worker 1 is stopped (SIGSTOP), requests routed to it wait there; SIGKILL: they are
    re-homed to worker 2, whose restore reads the handoff tier, and finish with the text one
    engine gives."""
    texts = [prompt(10 + i, 36) for i in range(4)]
    want = [complete(server.url, t)["choices"][0]["text"] for t in texts]
    pid = health(cluster)["workers"][1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(texts)) as pool:
            futures = [pool.submit(complete, cluster.url, t) for t in texts]
            time.sleep(3.0)     # every prefill half ends; decode halves wait on worker 1
            os.kill(pid, signal.SIGKILL)
            replies = [f.result(timeout=120) for f in futures]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert [r["choices"][0]["text"] for r in replies] == want
    outcomes = health(cluster)["handoffs"]["outcomes"]
    assert outcomes.get("rehomed", 0) >= 1, outcomes
    assert wait_for(lambda: get(cluster, "/ready")[1].get("workers_up") == 3, 60)
    settled(cluster)


def test_prefill_worker_killed_mid_prefill(cluster, server):
    """Worker 0 (prefill) is stopped, then killed with prefill halves on it: the decode
    workers prefill those requests themselves; same text, nothing leaked."""
    texts = [prompt(20 + i, 44) for i in range(3)]
    want = [complete(server.url, t)["choices"][0]["text"] for t in texts]
    pid = health(cluster)["workers"][0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(texts)) as pool:
            futures = [pool.submit(complete, cluster.url, t) for t in texts]
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            replies = [f.result(timeout=120) for f in futures]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert [r["choices"][0]["text"] for r in replies] == want
    outcomes = health(cluster)["handoffs"]["outcomes"]
    assert outcomes.get("prefill_lost", 0) >= 1, outcomes
    assert wait_for(lambda: get(cluster, "/ready")[1].get("workers_up") == 3, 60)
    settled(cluster)
    # and the restarted prefill worker takes handoffs again
    reply = complete(cluster.url, prompt(30, 40))
    assert trace(cluster, reply["id"])["routing"]["prefill_worker"] == 0
    settled(cluster)
