"""llm-d's prefill/decode protocol between two daemons (tiny model, real processes): a
prefill daemon (`kv_transfer.role = "prefill"`) and a decode daemon ("decode"), driven by
tests/llmd_sidecar.py (the sidecar's nixlv2 flow).

1. the decode daemon's text equals one engine's, its prompt restored from the blocks it
   pulled over TCP (trace: restored from "peer"); the prefill answer carries
   kv_transfer_params (remote_block_ids, remote_engine_id, remote_host, remote_port);
2. the prefill's leases are released once pulled, the decode's pulled files once its
   request ends: neither handoff tier keeps anything;
3. stale kv_transfer_params (a prefill daemon that is gone): the decode daemon prefills
   locally, same text; a prefill that answers 5xx: the sidecar falls back, same text;
4. kv_transfer_params on a daemon without kv_transfer.port: a 400 naming the field.
"""

from __future__ import annotations

import json
import socket

import pytest
from llmd_sidecar import pd_request

from tokenloom.actors.kv.tiers.handoff import stored_blocks

from client import admin, get, post
from servers import ServerProcess, wait_for

BLOCK = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon(tiny_model_dir, tmp, role: str) -> ServerProcess:
    s = ServerProcess(
        "--model", str(tiny_model_dir), "--set", "model.device=cpu",
        "--set", "model.dtype=float32", "--set", f"model.cache_dir={tmp / 'cache'}",
        "--set", f"cache.block_size={BLOCK}", "--set", "cache.num_blocks=512",
        "--set", f"admin.socket_path={tmp / (role + '.sock')}",
        "--set", f"kv_transfer.port={free_port()}", "--set", f"kv_transfer.role={role}",
        "--set", "kv_transfer.host=127.0.0.1", "--set", "kv_transfer.lease_seconds=3",
        timeout=180)
    s.admin = str(tmp / (role + '.sock'))
    s.kv = next(line for line in s.json_lines()
                if line.get("event") == "KV transfer server listening")
    return s


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llmd-pd")
    prefill = daemon(tiny_model_dir, tmp, "prefill")
    decode = daemon(tiny_model_dir, tmp, "decode")
    yield prefill, decode
    assert decode.stop() == 0
    prefill.stop()


def text(raw: bytes) -> str:
    return json.loads(raw)["choices"][0]["text"]


def prompt(i: int, n: int = 40) -> str:
    return " ".join(f"w{3 + (i * 37 + j * 11) % 250}" for j in range(n))


def body(p: str) -> dict:
    return {"prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}


def test_handoff_between_daemons_equals_one_engine(pair, server):
    prefill, decode = pair
    hp = f"127.0.0.1:{prefill.url.rsplit(':', 1)[1]}"
    for i in range(3):
        p = prompt(i, 30 + 6 * i)
        status, raw, info = pd_request(decode.url, hp, "/v1/completions", body(p))
        assert status == 200, raw
        assert not info["fallback"], info
        params = info["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_block_ids"], params
        assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == prefill.kv["port"]
        assert params["remote_engine_id"] == prefill.kv["engine_id"]
        want = complete_text(server, p)
        assert text(raw) == want, p
        reply = json.loads(raw)
        status, trace = get(decode, f"/v1/requests/{reply['id']}/trace")
        assert "peer" in str((trace.get("kv_tiers") or {}).get("plan")), trace
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            len(params["remote_block_ids"]) * BLOCK - BLOCK
    # Both daemons account for it: `tokenloom admin stats` has a kv_transfer row.
    p_stats = admin(prefill.admin, {"cmd": "stats"})["disaggregation"]
    d_stats = admin(decode.admin, {"cmd": "stats"})["disaggregation"]
    assert p_stats["mode"] == "kv_transfer" and p_stats["role"] == "prefill"
    assert p_stats["exports"] >= 3 and p_stats["blocks_served"] > 0
    assert d_stats["pulls"] >= 3 and d_stats["blocks_pulled"] == p_stats["blocks_served"]
    # Nothing is left in either handoff tier once leases settle (the prefill's written-
    # through blocks that no decode asked for expire with the lease).
    for d in pair:
        assert wait_for(lambda d=d: stored_blocks(d.kv["dir"]) == [], 10), d.kv["dir"]


def complete_text(server, p: str) -> str:
    status, reply = post(server, "/v1/completions", body(p))
    assert status == 200, reply
    return reply["choices"][0]["text"]


def test_stale_params_and_prefill_failure_fall_back_to_a_local_prefill(pair, server):
    prefill, decode = pair
    p = prompt(7, 44)
    want = complete_text(server, p)
    stale = {"do_remote_prefill": True, "do_remote_decode": False,
             "remote_block_ids": ["00" * 32], "remote_engine_id": "gone",
             "remote_host": "127.0.0.1", "remote_port": free_port()}
    status, reply = post(decode, "/v1/completions", {**body(p), "kv_transfer_params": stale})
    assert status == 200 and reply["choices"][0]["text"] == want, reply
    # A prefill pod that is not there at all: the sidecar falls back to a local prefill.
    status, raw, info = pd_request(decode.url, f"127.0.0.1:{free_port()}", "/v1/completions",
                                   body(p))
    assert status == 200 and info["fallback"] and text(raw) == want


def test_kv_transfer_params_refused_without_the_service(server):
    status, reply = post(server, "/v1/completions", {
        **body("w5 w6"), "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 400 and reply["error"]["param"] == "kv_transfer_params", reply
    status, reply = post(server, "/v1/completions", {
        **body("w5 w6"), "stream": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 400
