"""Issue #5 over HTTP, tiny model: priority classes and tenants from the body or headers,
the per-request trace (response metrics, GET /v1/requests/{id}/trace), the scheduling
metrics, and SLO-driven chunking against the static budget on a live engine."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from client import aget, apost

GREEDY = dict(temperature=0, ignore_eos=True)

EVENT_ORDER = ["request_received", "tokenized", "routed", "prefix_cache_lookup_done",
               "admitted", "prefill_started", "prefill_finished", "first_token", "final_token",
               "kv_blocks_released"]


async def test_trace_in_metrics_and_by_id(server, model_name):
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5 w6 w7", max_tokens=6, return_metrics=True,
        metadata={"cohort": "b"}, **GREEDY))
    assert status == 200, body
    (trace,) = body["metrics"]["trace"]
    # the request's metadata, whole as parsed (the client's labels included)
    assert trace["meta"]["labels"] == {"cohort": "b"} and trace["meta"]["priority"] == 0
    assert [e["event"] for e in trace["events"]] == EVENT_ORDER
    times = [e["t"] for e in trace["events"]]
    assert times == sorted(times) and times[0] == 0.0
    assert trace["decode"]["iterations"] == 5 and trace["decode"]["max_gap_s"] >= 0
    assert trace["prefill_chunks"] == 1 and trace["finish_reason"] == "length"
    assert trace["kv_plan"]["decision"] == "admit" and trace["preemptions"] == []
    # The same trace by the id the client saw.
    status, raw, _ = await aget(server, f"/v1/requests/{body['id']}/trace")
    assert status == 200
    assert json.loads(raw)["events"] == trace["events"]


async def test_trace_of_several_choices_and_unknown_id(server, model_name):
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5 w6", max_tokens=3, n=2, temperature=0.8, seed=1))
    assert status == 200, body
    status, raw, _ = await aget(server, f"/v1/requests/{body['id']}/trace")
    got = json.loads(raw)
    assert status == 200 and got["request_id"] == body["id"]
    assert [c["request_id"] for c in got["choices"]] == [f"{body['id']}-0", f"{body['id']}-1"]
    status, raw, _ = await aget(server, "/v1/requests/cmpl-nope/trace")
    err = json.loads(raw)["error"]
    assert status == 404 and err["param"] == "request_id" and "cmpl-nope" in err["message"]


@pytest.mark.parametrize("body_priority, header, expected", [
    ("batch", None, 10), ("interactive", None, 0), (7, None, 7), (None, "batch", 10),
    (None, "-3", -3), (None, None, 0), (3, "batch", 3)])
async def test_priority_from_body_or_header(server, model_name, body_priority, header,
                                            expected):
    extra = {} if body_priority is None else {"priority": body_priority}
    headers = {} if header is None else {"X-Priority": header}
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5", max_tokens=1, return_metrics=True, **GREEDY, **extra),
        headers=headers)
    assert status == 200, body
    assert body["metrics"]["trace"][0]["priority"] == expected


async def test_tenant_from_user_or_header(server, model_name):
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5", max_tokens=1, user="alice", return_metrics=True,
        **GREEDY))
    assert body["metrics"]["trace"][0]["tenant"] == "alice"
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5", max_tokens=1, user="alice", return_metrics=True,
        **GREEDY), headers={"X-Tenant": "team-b"})
    assert body["metrics"]["trace"][0]["tenant"] == "team-b"


@pytest.mark.parametrize("extra, headers, param", [
    ({"priority": "urgent"}, {}, "priority"), ({"priority": 2**31}, {}, "priority"),
    ({}, {"X-Priority": "vip"}, "X-Priority")])
async def test_bad_priority_is_a_400_naming_the_field(server, model_name, extra, headers,
                                                      param):
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5", max_tokens=1, **extra), headers=headers)
    assert status == 400 and body["error"]["param"] == param
    if param != "priority" or isinstance(extra.get("priority"), str):
        assert "interactive" in body["error"]["message"]  # lists the configured classes


async def test_scheduling_metrics_are_exported(server, model_name):
    await apost(server, "/v1/completions", dict(model=model_name, prompt="w5", max_tokens=2,
                                               **GREEDY))
    status, raw, _ = await aget(server, "/metrics")
    text = raw.decode()
    for name in ("tokenloom:max_decode_skip", "tokenloom:goodput_requests_total",
                 "tokenloom:slo_evaluated_requests_total", "tokenloom:goodput_ratio",
                 'tokenloom:preemptions_total{mode="swap"', "tokenloom:admission_paused",
                 "tokenloom:prefill_chunk_budget_tokens"):
        assert name in text, name
    line = next(ln for ln in text.splitlines() if ln.startswith("tokenloom:max_decode_skip"))
    assert float(line.split()[-1]) == 0.0


def _serve(tiny_model_dir, tmp_path, **overrides):
    from servers import ServerThread, tiny_config

    return ServerThread(tiny_config(tiny_model_dir, tmp_path, **overrides))


async def _interference(server, model_name) -> dict:
    """4 streams decode; once the cost model has data, a 600-token prompt arrives. Returns
    the long request's trace."""
    async def stream(session):
        body = dict(model=model_name, prompt="w1 w2 w3", max_tokens=120, stream=True, **GREEDY)
        async with session.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.read()

    async with aiohttp.ClientSession() as session:
        streams = [asyncio.create_task(stream(session)) for _ in range(4)]
        # Let >= 16 iterations of decodes feed the cost model before the long prompt.
        deadline = time.monotonic() + 120
        while (await asyncio.to_thread(server.stats)).scheduler.num_steps < 30:
            assert time.monotonic() < deadline, "the streams never took 30 steps"
            await asyncio.sleep(0.02)
        body = dict(model=model_name, prompt=[5 + (i % 50) for i in range(600)], max_tokens=2,
                    return_metrics=True, **GREEDY)
        async with session.post(server.url + "/v1/completions", json=body) as r:
            long = await r.json()
        await asyncio.gather(*streams)
    return long["metrics"]["trace"][0]


async def test_slo_chunking_splits_a_long_prompt_that_static_runs_whole(tiny_model_dir,
                                                                        tmp_path, model_name):
    """Same workload, two engines: with the static budget (512 tokens) the 600-token prompt
    takes 2 chunks; with an unreachable ITL target it is cut into min_prefill_chunk (32)
    pieces while the streams keep decoding — and every running decode still ran every
    iteration (max_decode_skip 0)."""
    static = _serve(tiny_model_dir, tmp_path / "a", **{"scheduler.chunking": "static"})
    try:
        t_static = await _interference(static, model_name)
        assert static.stats().scheduler.prefill_budget is None
    finally:
        static.close()
    slo = _serve(tiny_model_dir, tmp_path / "b", **{"scheduler.chunking": "slo",
                                                    "scheduler.target_itl_ms": 0.001,
                                                    "scheduler.min_prefill_chunk": 32})
    try:
        t_slo = await _interference(slo, model_name)
        stats = slo.stats().scheduler
        assert stats.cost_model is not None and stats.max_decode_skip == 0
    finally:
        slo.close()
    assert t_static["prefill_chunks"] == 2
    assert t_slo["prefill_chunks"] >= 600 // 32


async def _greedy_texts(server, model_name, prompts, max_tokens=40) -> list[str]:
    async def one(session, prompt):
        body = dict(model=model_name, prompt=prompt, max_tokens=max_tokens, **GREEDY)
        async with session.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["text"]
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(one(session, p) for p in prompts))


@pytest.mark.parametrize("mode", ["swap", "auto"])
async def test_swap_and_auto_preemption_leave_greedy_output_identical(
        server, tiny_model_dir, tmp_path, model_name, mode):
    """8 concurrent requests (40-token prompts, 40 tokens out) in a 24-block pool of 8
    tokens, with the KV plan off so that victims are certain: the text equals the big-pool
    server's, victims were swapped (mode swap: all of them), and every slot came back."""
    prompts = [[10 + (i * 7 + k) % 90 for k in range(40)] for i in range(8)]
    expected = await _greedy_texts(server, model_name, prompts)
    small = _serve(tiny_model_dir, tmp_path, **{
        "cache.num_blocks": 24, "scheduler.preemption_mode": mode,
        "cache.swap_space_bytes": 1 << 20, "scheduler.admission_lookahead_tokens": 0,
        "scheduler.kv_watermark": 0.0, "scheduler.kv_resume_watermark": 0.0})
    try:
        got = await _greedy_texts(small, model_name, prompts)
        stats = await asyncio.to_thread(small.wait_idle)
    finally:
        small.close()
    assert got == expected
    assert stats["num_preemptions"] > 0 and stats["used"] == 0
    assert stats["swap_free_slots"] == small.engine.scheduler.core.preemptor.swap.num_slots
    if mode == "swap":
        assert stats["num_swap_preemptions"] == stats["num_preemptions"]


async def test_interactive_class_is_admitted_before_queued_batch_work(tiny_model_dir,
                                                                     tmp_path, model_name):
    """One sequence slot; six "batch" requests queue up, then one "interactive" request
    arrives: it is admitted as soon as the slot frees, ahead of the five batch requests
    still waiting."""
    s = _serve(tiny_model_dir, tmp_path, **{"scheduler.max_num_seqs": 1,
                                            "scheduler.max_num_batched_tokens": 64})
    try:
        async def one(session, priority, i):
            body = dict(model=model_name, prompt=[5 + i, 6, 7], max_tokens=30,
                        return_metrics=True, priority=priority, **GREEDY)
            async with session.post(s.url + "/v1/completions", json=body) as r:
                trace = (await r.json())["metrics"]["trace"][0]
            admitted = next(e["t"] for e in trace["events"] if e["event"] == "admitted")
            return trace["received_at"] + admitted

        async with aiohttp.ClientSession() as session:
            batch = [asyncio.create_task(one(session, "batch", i)) for i in range(6)]
            deadline = time.monotonic() + 120
            while (await asyncio.to_thread(s.stats)).scheduler.waiting < 5:
                assert time.monotonic() < deadline, "the batch requests never queued"
                await asyncio.sleep(0.01)
            vip = await one(session, "interactive", 99)
            batch_admitted = sorted(await asyncio.gather(*batch))
    finally:
        s.close()
    assert sum(t < vip for t in batch_admitted) <= 2   # the running one (and one racing)
    assert sum(t > vip for t in batch_admitted) >= 4


async def test_a_prompt_that_can_never_fit_the_pool_is_a_400_naming_the_limit(
        tiny_model_dir, tmp_path, model_name):
    s = _serve(tiny_model_dir, tmp_path, **{"cache.num_blocks": 8})   # 64 tokens of KV
    try:
        status, body, _ = await apost(s, "/v1/completions", dict(
            model=model_name, prompt=list(range(5, 105)), max_tokens=1))
    finally:
        s.close()
    assert status == 400
    assert "64" in body["error"]["message"], body
