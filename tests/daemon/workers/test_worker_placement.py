"""Worker placement and the stats aggregate: pure, no processes."""

from __future__ import annotations

import msgspec
import pytest

from tokenloom.actors.kv.prefix_cache import PrefixCacheStats
from tokenloom.actors.messages import EngineStats, KVStats, RouterStats, SchedulerStats, StepTimings
from tokenloom.config.load import load_config
from tokenloom.config.schema import ConfigError
from tokenloom.daemon.workers import aggregate
from tokenloom.daemon.workers.supervisor import (
    offset_endpoint,
    role,
    worker_configs,
    worker_env,
)


def cfg(**overrides):
    return load_config(overrides=overrides, env=None)


def test_count_is_validated_with_field_and_range():
    with pytest.raises(ConfigError, match=r"workers\.count must be >= 1 and <= 64, got 0"):
        cfg(**{"workers.count": 0})
    with pytest.raises(ConfigError, match=r"workers\.routing must be one of"):
        cfg(**{"workers.routing": "random"})


def test_cpu_workers_share_the_threads():
    configs = worker_configs(cfg(**{"workers.count": 2, "model.device": "cpu",
                                    "model.num_threads": 5}))
    assert [c.model.num_threads for c in configs] == [2, 2]
    assert all(c.model.device == "cpu" and c.workers.count == 1 for c in configs)
    assert worker_env(configs[0])["OMP_NUM_THREADS"] == "2"
    # 0 threads: the host's cores, at least one each.
    configs = worker_configs(cfg(**{"workers.count": 3, "model.device": "cpu"}), num_cpus=2)
    assert [c.model.num_threads for c in configs] == [1, 1, 1]


def test_cuda_workers_get_one_gpu_each():
    configs = worker_configs(cfg(**{"workers.count": 2, "model.device": "cuda"}), num_gpus=4)
    assert [c.model.device for c in configs] == ["cuda:0", "cuda:1"]
    configs = worker_configs(cfg(**{"workers.count": 2}), num_gpus=2)   # auto with GPUs
    assert [c.model.device for c in configs] == ["cuda:0", "cuda:1"]
    with pytest.raises(ConfigError, match=r"workers\.count must be <= 2 .*got 3"):
        worker_configs(cfg(**{"workers.count": 3, "model.device": "cuda"}), num_gpus=2)
    with pytest.raises(ConfigError, match=r"model\.device 'cuda:1' pins one GPU"):
        worker_configs(cfg(**{"workers.count": 2, "model.device": "cuda:1"}), num_gpus=2)


def test_kv_event_endpoints_are_offset_per_worker():
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///run/kv", 1) == "ipc:///run/kv-1"
    assert offset_endpoint("", 1) == ""
    configs = worker_configs(cfg(**{"workers.count": 2, "model.device": "cpu",
                                    "kv_events.enable_kv_cache_events": True,
                                    "kv_events.replay_endpoint": "tcp://*:6000"}))
    assert [(c.kv_events.endpoint, c.kv_events.replay_endpoint) for c in configs] == [
        ("tcp://*:5557", "tcp://*:6000"), ("tcp://*:5558", "tcp://*:6001")]


def test_prefill_workers_write_the_handoff_tier_and_decode_workers_read_it(tmp_path):
    handoff = str(tmp_path / "handoff")
    config = cfg(**{"workers.count": 3, "workers.prefill": 1, "model.device": "cpu",
                    "workers.handoff_bytes": 64 << 20})
    assert [role(config, i) for i in range(3)] == ["prefill", "decode", "decode"]
    configs = worker_configs(config, num_cpus=2, handoff_dir=handoff)
    assert [c.kv_tiers.peer_write for c in configs] == ["through", "off", "off"]
    for c in configs:
        t = c.kv_tiers
        assert t.enabled and t.peer_path == handoff and t.peer_bytes == 64 << 20
        # The user had the tiers off: only the handoff tier, no host/disk/remote tier.
        assert (t.host_bytes, t.disk_path, t.remote_url) == (0, "", "")
        # Each worker is a whole engine of its own: no roles inside it.
        assert (c.workers.count, c.workers.prefill) == (1, 0)
        assert role(c, 0) == "both"
    # Tiers the user enabled are kept beside the handoff tier.
    config = cfg(**{"workers.count": 2, "workers.prefill": 1, "model.device": "cpu",
                    "kv_tiers.enabled": True, "kv_tiers.host_bytes": 32 << 20})
    configs = worker_configs(config, num_cpus=2, handoff_dir=handoff)
    assert [c.kv_tiers.host_bytes for c in configs] == [32 << 20, 32 << 20]
    assert [c.kv_tiers.peer_write for c in configs] == ["through", "off"]
    # Without disaggregation (or without a handoff directory) the tiers are untouched.
    plain = cfg(**{"workers.count": 2, "model.device": "cpu"})
    assert [role(plain, i) for i in range(2)] == ["both", "both"]
    assert all(c.kv_tiers == plain.kv_tiers
               for c in worker_configs(plain, num_cpus=2, handoff_dir=handoff))
    assert worker_configs(config, num_cpus=2)[0].kv_tiers == config.kv_tiers


def test_prefill_workers_need_prefix_caching_and_a_decode_worker(tmp_path):
    config = cfg(**{"workers.count": 3, "workers.prefill": 1, "model.device": "cpu",
                    "cache.enable_prefix_caching": False})
    with pytest.raises(ConfigError, match=r"workers\.prefill needs cache\.enable_prefix_caching"
                       ) as e:
        worker_configs(config, num_cpus=2, handoff_dir=str(tmp_path))
    assert e.value.key == "workers.prefill"
    for prefill in (3, 4):
        with pytest.raises(ConfigError, match=r"workers\.prefill must leave at least one "
                           r"decode worker") as e:
            cfg(**{"workers.count": 3, "workers.prefill": prefill})
        assert e.value.key == "workers.prefill"
    assert cfg(**{"workers.count": 3, "workers.prefill": 2}).workers.prefill == 2


def _stats(used, hits, skip, timing):
    pc = PrefixCacheStats(queried_tokens=100, hit_tokens=hits, missed_tokens={"cold": 1})
    sched = SchedulerStats(waiting=1, running=2, in_flight_steps=0, overlap=True, num_steps=10,
                           num_forks=0, num_preemptions=1, num_swap_preemptions=0,
                           num_free_blocks=5, max_decode_skip=skip, admission_paused=False,
                           prefill_budget=None, cost_model=[1.0, 2.0], swap_free_slots=None,
                           num_slo_evaluated=0, num_slo_good=0,
                           timings=StepTimings(steps=3, forward_ms=timing))
    kv = KVStats(num_blocks=10, free=10 - used, used=used, usage=used / 10, block_size=16,
                 cached_blocks=1, prefix_cache=pc)
    return EngineStats(scheduler=sched, kv=kv, router=RouterStats(in_flight=0, capacity=1,
                                                                  num_rejected=0))


def test_aggregate_sums_counts_and_recomputes_ratios():
    total = aggregate.engine_stats([_stats(2, 30, 1, 4.0), _stats(6, 50, 3, 8.0)],
                                   RouterStats(in_flight=7, capacity=0, num_rejected=1))
    assert total.scheduler.running == 4 and total.scheduler.num_steps == 20
    assert total.scheduler.max_decode_skip == 3
    assert total.scheduler.timings.forward_ms == 6.0 and total.scheduler.timings.steps == 6
    assert total.scheduler.cost_model == [1.0, 2.0]
    assert (total.kv.num_blocks, total.kv.used, total.kv.block_size) == (20, 8, 16)
    assert total.kv.usage == pytest.approx(0.4)
    assert total.kv.prefix_cache.hit_tokens == 80
    assert total.kv.prefix_cache.missed_tokens == {"cold": 2}
    assert total.router.in_flight == 7
    msgspec.msgpack.encode(total)   # still a valid message


def test_a_worker_that_cannot_start_fails_serve_with_its_error(tmp_path):
    """Like the in-process engine: one line naming the problem, exit status 2, and no
    worker process left behind."""
    import subprocess
    import sys
    from pathlib import Path

    tokenloom = str(Path(sys.executable).with_name("tokenloom"))
    proc = subprocess.Popen([tokenloom, "serve", "--port", "0", "--workers", "2", "--model",
                             str(tmp_path / "missing"), "--set", "model.device=cpu",
                             "--set", "admin.enabled=false"], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert stderr.strip().splitlines()[-1].startswith("tokenloom: engine worker ")
    assert f"model directory '{tmp_path / 'missing'}' does not exist" in stderr
    ps = subprocess.run(["pgrep", "-f", f"workers.worker .*--parent {proc.pid}( |$)"],
                        capture_output=True, text=True)
    def running(pid: str) -> bool:
        try:
            return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except OSError:   # gone meanwhile
            return False

    alive = [pid for pid in ps.stdout.split() if running(pid)]
    assert not alive, "worker processes outlived the daemon"
