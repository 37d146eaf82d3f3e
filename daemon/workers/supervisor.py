"""Worker placement and process start-up: which device and threads each worker gets, and
the command that starts one incarnation of it.

Placement (`worker_configs`): on CUDA (model.device "cuda" or "auto" with a GPU), worker i
runs on cuda:i, so workers.count may not exceed the GPUs; a pinned "cuda:N" serves one GPU
and cannot be shared by several workers. On CPU, each worker gets its share of the threads
(model.num_threads, or the host's cores when that is 0), at least one, through
model.num_threads and OMP_NUM_THREADS / MKL_NUM_THREADS in its environment (libgomp reads
them at start-up, before torch can be told). KV event endpoints, when enabled, are offset
per worker as vLLM does for data-parallel ranks (tcp port + i, ipc path + "-i").
"""

from __future__ import annotations

import asyncio
import os
import re
import sys

import msgspec

from tokenloom.config.schema import ConfigError, EngineConfig


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_configs(config: EngineConfig, num_gpus: int | None = None,
                   num_cpus: int | None = None,
                   handoff_dir: str | None = None) -> list[EngineConfig]:
    """One config per worker (each with workers.count = 1). Raises ConfigError when the
    placement is impossible, naming the key."""
    n = config.workers.count
    device = config.model.device
    if num_gpus is None:
        num_gpus = cuda_device_count() if device in ("auto", "cuda") else 0
    replace = msgspec.structs.replace
    out = []
    if device.startswith("cuda:"):
        raise ConfigError(f"model.device {device!r} pins one GPU; with workers.count = {n} use "
                          f"model.device = \"cuda\" (worker i runs on cuda:i)",
                          key="model.device")
    use_cuda = device == "cuda" or (device == "auto" and num_gpus > 0)
    if use_cuda and n > num_gpus:
        raise ConfigError(f"workers.count must be <= {num_gpus} (one worker per GPU; this host "
                          f"has {num_gpus}), got {n}", key="workers.count")
    total_threads = config.model.num_threads or num_cpus or os.cpu_count() or 1
    threads = max(1, total_threads // n)
    for i in range(n):
        model = (replace(config.model, device=f"cuda:{i}") if use_cuda
                 else replace(config.model, device="cpu", num_threads=threads))
        kv = config.kv_events
        if kv.enable_kv_cache_events:
            kv = replace(kv, endpoint=offset_endpoint(kv.endpoint, i),
                         replay_endpoint=offset_endpoint(kv.replay_endpoint, i))
        out.append(replace(config, model=model, kv_events=kv,
                           kv_tiers=handoff_tiers(config, i, handoff_dir),
                           workers=replace(config.workers, count=1, prefill=0)))
    return out


def role(config: EngineConfig, i: int) -> str:
    """Worker i's role: "prefill" (the first workers.prefill), "decode" (the rest when
    there are prefill workers) or "both" (no disaggregation)."""
    if not config.workers.prefill:
        return "both"
    return "prefill" if i < config.workers.prefill else "decode"


def handoff_tiers(config: EngineConfig, i: int, handoff_dir: str | None):
    """Worker i's [kv_tiers]: with disaggregation, the handoff tier at `handoff_dir`
    (written through by prefill workers, read by decode workers) beside whatever tiers the
    user configured; the other tiers keep their settings only if the user enabled them."""
    tiers = config.kv_tiers
    if role(config, i) == "both" or not handoff_dir:
        return tiers
    if not config.cache.enable_prefix_caching:
        raise ConfigError("workers.prefill needs cache.enable_prefix_caching: a handoff is "
                          "keyed by the prefix cache's block hashes", key="workers.prefill")
    replace = msgspec.structs.replace
    base = tiers if tiers.enabled else replace(tiers, host_bytes=0, disk_path="",
                                               remote_url="")
    w = config.workers
    return replace(base, enabled=True, peer_path=handoff_dir, peer_bytes=w.handoff_bytes,
                   peer_write="through" if role(config, i) == "prefill" else "off",
                   peer_prior_mb_s=w.handoff_prior_mb_s)


def offset_endpoint(endpoint: str, i: int) -> str:
    """Worker i's copy of a ZMQ endpoint: tcp port + i, ipc/inproc name + "-i" ("" stays)."""
    if not endpoint or i == 0:
        return endpoint
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if m:
        return f"{m.group(1)}{int(m.group(2)) + i}"
    return f"{endpoint}-{i}"


def worker_env(config: EngineConfig) -> dict[str, str]:
    env = dict(os.environ)
    if config.model.device == "cpu" and config.model.num_threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(config.model.num_threads)
    return env


async def spawn(config: EngineConfig, index: int, incarnation: int, in_addr: str,
                out_addr: str) -> asyncio.subprocess.Process:
    """Start one worker process; its stderr (JSON log lines) is the daemon's."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tokenloom.daemon.workers.worker", "--index", str(index),
        "--incarnation", str(incarnation), "--in-addr", in_addr, "--out-addr", out_addr,
        "--parent", str(os.getpid()), stdin=asyncio.subprocess.PIPE,
        env=worker_env(config))
    proc.stdin.write(msgspec.json.encode(config))
    await proc.stdin.drain()
    proc.stdin.close()
    return proc
