"""KV tiers in a running engine (tiny model, a device pool far smaller than the prompts'
prefixes): evicted prefixes come back from host memory, disk (also after a restart) and a
real Redis server, with the same greedy tokens and logprobs as recomputing them; faults
(a corrupt disk block, a server killed mid-restore, another tenant's salt) fall back to
recompute without leaking a block."""

from __future__ import annotations

import threading
import time

import pytest

from tokenloom import LLM, SamplingParams

from tinymodel import build_tiny_model

PROMPTS = [[5 + (i * 11 + k) % 150 for k in range(40)] for i in range(6)]
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tiers")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2), seed=7)
    return path


def _llm(model_dir, tmp_path, **tiers):
    opts = {f"kv_tiers.{k}": v for k, v in tiers.items()}
    if tiers:
        opts["kv_tiers.enabled"] = True
    return LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
               cache_dir=str(tmp_path / "cache"), block_size=8, num_blocks=24, max_num_seqs=2,
               **opts)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _logprobs(outs):
    return [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]


@pytest.fixture(scope="module")
def baseline(model_dir, tmp_path_factory):
    with _llm(model_dir, tmp_path_factory.mktemp("base")) as llm:
        outs = llm.generate(PROMPTS, SP)
        return _tokens(outs), _logprobs(outs)


def _by_tier(outs):
    total: dict[str, int] = {}
    for o in outs:
        for tier, n in (o.outputs[0].timings.cached_tokens_by_tier or {}).items():
            total[tier] = total.get(tier, 0) + n
    return total


def _same_as_baseline(outs, baseline):
    tokens, logprobs = baseline
    assert _tokens(outs) == tokens
    for got, want in zip(_logprobs(outs), logprobs):
        assert got == pytest.approx(want, abs=1e-4)


def test_host_tier_restores_evicted_prefixes_exactly(model_dir, tmp_path, baseline):
    with _llm(model_dir, tmp_path, host_bytes=1 << 24) as llm:
        _same_as_baseline(llm.generate(PROMPTS, SP), baseline)
        outs = llm.generate(PROMPTS, SP)
        _same_as_baseline(outs, baseline)
        by_tier = _by_tier(outs)
        assert by_tier.get("host", 0) >= 64, by_tier
        # cached_tokens stays exact: it is the sum over where the KV came from.
        for o in outs:
            t = o.outputs[0].timings
            assert t.num_cached_tokens == sum((t.cached_tokens_by_tier or {}).values())
        restored = [o for o in outs if "host" in (o.outputs[0].timings.cached_tokens_by_tier
                                                   or {})]
        assert restored[0].outputs[0].timings.prefix_miss_reason.endswith("_restored_from_host")
        trace = llm.trace(restored[0].request_id)[-1]["kv_tiers"]
        assert trace["plan"]["ranges"][0]["tier"] == "host"
        assert "regret_ms" in trace and "predicted_ttft_ms" in trace["plan"]
        stats = llm.kv_stats()
        host = stats.tiers.tiers[0]
        assert host.counters.hits * 8 == by_tier["host"] and host.num_blocks > 0
        # The prefix cache's counters stay consistent: queried = hit + missed.
        pc = stats.prefix_cache
        assert pc.missed_tokens.get("evicted_restored_from_host", 0) > 0
        assert pc.queried_tokens == pc.hit_tokens + sum(pc.missed_tokens.values()) \
            - pc.missed_tokens["recompute_after_preempt"]
        llm.check_integrity()


def test_always_recompute_planner_restores_nothing(model_dir, tmp_path, baseline):
    with _llm(model_dir, tmp_path, host_bytes=1 << 24, planner="always_recompute") as llm:
        llm.generate(PROMPTS, SP)
        outs = llm.generate(PROMPTS, SP)
        _same_as_baseline(outs, baseline)
        assert "host" not in _by_tier(outs)


def test_disk_tier_survives_a_restart_and_announces_its_blocks(model_dir, tmp_path, baseline):
    disk = str(tmp_path / "disk")
    with _llm(model_dir, tmp_path, host_bytes=0, disk_path=disk, disk_write="through") as llm:
        _same_as_baseline(llm.generate(PROMPTS, SP), baseline)
        llm.wait_for_idle()
    events = []
    with _llm(model_dir, tmp_path, host_bytes=0, disk_path=disk) as llm:
        llm.subscribe_kv_events(events.append)
        outs = llm.generate(PROMPTS[:2], SP)
        _same_as_baseline(outs, (baseline[0][:2], baseline[1][:2]))
        assert _by_tier(outs).get("disk", 0) == 2 * 32
        assert outs[0].outputs[0].timings.prefix_miss_reason == "no_prefix_restored_from_disk"
        llm.check_integrity()
    # The restarted daemon announced what its disk holds (before the subscription here, so
    # only its new blocks are seen) and the device's new blocks.
    assert any(getattr(e, "medium", None) == "GPU" for e in events)


def test_corrupt_disk_block_falls_back_to_recompute(model_dir, tmp_path, baseline):
    disk = tmp_path / "disk"
    with _llm(model_dir, tmp_path, host_bytes=0, disk_path=str(disk),
              disk_write="through") as llm:
        llm.generate(PROMPTS[:1], SP)
        llm.wait_for_idle()
    files = sorted(disk.rglob("*.kvb"))
    assert files
    for f in files:      # every block of the prompt: corrupt its payload
        data = bytearray(f.read_bytes())
        data[-10] ^= 0xFF
        f.write_bytes(bytes(data))
    with _llm(model_dir, tmp_path, host_bytes=0, disk_path=str(disk)) as llm:
        outs = llm.generate(PROMPTS[:1], SP)
        _same_as_baseline(outs, (baseline[0][:1], baseline[1][:1]))
        assert _by_tier(outs).get("disk", 0) == 0
        disk_stats = llm.kv_stats().tiers.tiers[0]
        assert disk_stats.degraded and "crc" in disk_stats.degraded_reason
        llm.check_integrity()
        # It recovers by itself: the next good write (evictions, here) clears the flag.
        llm.generate(PROMPTS[1:], SP)
        llm.wait_for_idle()
        time.sleep(0.3)
        assert not llm.kv_stats().tiers.tiers[0].degraded


def test_remote_tier_is_shared_between_daemons(model_dir, tmp_path, baseline, redis_server):
    with _llm(model_dir, tmp_path, host_bytes=0, remote_url=redis_server.url,
              remote_write="through") as llm:
        llm.generate(PROMPTS, SP)
        llm.wait_for_idle()
        time.sleep(0.3)    # writes are asynchronous
    assert redis_server.client().dbsize() >= len(PROMPTS) * 4
    # Another daemon (nothing on its device, no host or disk tier): served from the server.
    with _llm(model_dir, tmp_path, host_bytes=0, remote_url=redis_server.url) as llm:
        outs = llm.generate(PROMPTS, SP)
        _same_as_baseline(outs, baseline)
        assert _by_tier(outs).get("remote", 0) >= 32, _by_tier(outs)
        # Another tenant's salt never reads them.
        salted = llm.generate(PROMPTS[:2], SP, cache_salt="tenant-b")
        assert _by_tier(salted).get("remote", 0) == 0
        llm.check_integrity()


def test_remote_killed_mid_restore_falls_back_and_recovers(model_dir, tmp_path, baseline,
                                                           redis_server):
    with _llm(model_dir, tmp_path, host_bytes=0, remote_url=redis_server.url,
              remote_write="through") as llm:
        llm.generate(PROMPTS, SP)
        llm.wait_for_idle()
        time.sleep(0.3)
    # A slow link (300 ms a call, emulated on the client), killed while the first restore
    # runs; the planner thinks the link is fast, so it restores.
    with _llm(model_dir, tmp_path, host_bytes=0, remote_url=redis_server.url,
              remote_shaping=[300.0, 1000.0], remote_prior_mb_s=1000.0,
              remote_prior_latency_ms=0.1, recompute_prior_ms_per_token=20.0,
              remote_retry_after_s=0.2, remote_write="through") as llm:
        killer = threading.Timer(0.15, redis_server.kill)
        killer.start()
        outs = llm.generate(PROMPTS[:3], SP)
        killer.join()
        _same_as_baseline(outs, (baseline[0][:3], baseline[1][:3]))
        remote = llm.kv_stats().tiers.tiers[0]
        assert remote.degraded
        llm.check_integrity()
        redis_server.restart()
        time.sleep(0.3)
        llm.generate(PROMPTS[3:4], SP)      # writes through to the restarted server
        llm.wait_for_idle()
        time.sleep(0.3)
        llm.engine.tiers.drain_writes()
        assert not llm.kv_stats().tiers.tiers[0].degraded
