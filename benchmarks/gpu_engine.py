"""The GPU check's engine part: the real engine, offline and over HTTP (issue 13).

`benchmarks/gpu_check.py` runs it after its graph and kernel benchmarks (`--skip-engine`
leaves it out). It writes a random checkpoint of a real shape (the GPU host carries no
model files: `kernels/random_model.write_checkpoint`) and measures three things:

1. offline: `LLM(device=...)` over that checkpoint generates greedily for a batch of prompts
   (half of them sharing a prefix); tokens/s, the runner's graph statistics for the timed
   call (graph and eager steps with their reasons, replays, padding), and the device's busy
   fraction from torch.profiler (union of the kernels' intervals / wall time of the call);
2. parity: a tiny random checkpoint in fp32, greedy through `LLM` against transformers'
   `generate` on the same device (the oracle of tests/kernels/models/test_tiny_models.py);
3. HTTP: `tokenloom serve` as a subprocess on 127.0.0.1 over the same checkpoint, a
   time-bounded closed loop of streaming /v1/completions requests (benchmarks/harness.py's
   client), TTFT/ITL percentiles and tokens/s, the GPU's busy fraction sampled from NVML
   during the load, and the graph counters of /metrics over the load window.

`DRY_PLAN` runs every step on the CPU with the tiny shape (NVML is recorded as unavailable)
so CI executes the code the GPU host will. Each step records an error with its traceback
instead of raising: one broken step must not hide the others' numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import importlib.util
import os
import random
import re
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    device: str
    dtype: str                 # of the shaped checkpoint (parity always runs in fp32)
    shape: str                 # kernels/random_model.SHAPES
    num_prompts: int           # offline batch
    prompt_len: int
    shared_prefix_len: int     # the first half of the prompts share this many tokens
    output_len: int
    max_num_seqs: int
    num_blocks: int            # KV pool, fixed: the server must not take the whole GPU
    http_streams: int
    http_seconds: float        # new requests start until then; running ones finish
    http_output_len: int
    busy_interval_s: float     # NVML sampling period
    parity_prompt_lens: tuple[int, ...]
    parity_tokens: int
    server_timeout_s: float    # start-up (load, smoke test, Triton precompile, capture)
    # model.attention_backend: "auto" is Triton on CUDA; the dry run takes the torch
    # reference, so that its time does not hang on building the C++ CPU kernel (~1 min cold).
    attention_backend: str = "auto"


# One H200, 135M shape in bf16: ~2-3 minutes with start-ups (engine, server, transformers).
GPU_PLAN = EnginePlan(device="cuda", dtype="bfloat16", shape="smollm2-135m", num_prompts=64,
                      prompt_len=128, shared_prefix_len=96, output_len=64, max_num_seqs=64,
                      num_blocks=8192, http_streams=64, http_seconds=25.0, http_output_len=128,
                      busy_interval_s=0.1, parity_prompt_lens=(130, 7, 33, 64, 5),
                      parity_tokens=16, server_timeout_s=180.0)
# The same steps on CPU with the tiny shape, in well under a minute on 2 cores.
DRY_PLAN = EnginePlan(device="cpu", dtype="float32", shape="tiny", num_prompts=8,
                      prompt_len=24, shared_prefix_len=16, output_len=8, max_num_seqs=8,
                      num_blocks=256, http_streams=8, http_seconds=3.0, http_output_len=8,
                      busy_interval_s=0.2, parity_prompt_lens=(20, 7, 13), parity_tokens=8,
                      server_timeout_s=120.0, attention_backend="torch")
FIRST_WORD_ID = 3   # ids 0-2 are <unk>, <s>, </s> in every shape's word tokenizer
# What `tokenloom serve` imports beyond the engine; checked before starting it, so that a
# missing one is named at once instead of by a server that died in start-up.
SERVER_MODULES = ("aiohttp", "uvloop", "prometheus_client")


def _load_by_path(name: str, path: Path):
    """Import a sibling script (benchmarks/ and tests/ are not packages)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module    # before exec: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def bench_harness():
    """benchmarks/harness.py: servers, the load generator's SSE client and its summary."""
    return _load_by_path("tokenloom_bench_harness", ROOT / "benchmarks" / "harness.py")


# -- pure helpers (tested on CPU) --------------------------------------------------------------
def union_seconds(intervals) -> float:
    """Total length of the union of (start, end) intervals, in their unit."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def make_prompts(n: int, length: int, shared: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts of ordinary words; the first half begin with one shared prefix."""
    rng = random.Random(seed)
    word = lambda: rng.randrange(FIRST_WORD_ID, vocab)  # noqa: E731
    prefix = [word() for _ in range(shared)]
    return [(prefix if i < n // 2 else [word() for _ in range(shared)])
            + [word() for _ in range(length - shared)] for i in range(n)]


def stats_delta(before: dict, after: dict) -> dict:
    """`after - before` for the runner's graph statistics: counters and per-key counts
    subtract, the rest (flags, sizes) is taken from `after`."""
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, bool) or key in ("capture_seconds", "capture_bytes") \
                or key.endswith("fraction"):   # not counters (padding waste: below)
            out[key] = value
        elif isinstance(value, (int, float)) and isinstance(old, (int, float)):
            out[key] = value - old
        elif isinstance(value, dict):
            old = old or {}
            diff = {k: v - old.get(k, 0) for k, v in value.items()
                    if isinstance(v, (int, float))}
            out[key] = {k: v for k, v in diff.items() if v}
        else:
            out[key] = value
    rows = out.get("graph_real_rows", 0) + out.get("graph_padded_rows", 0)
    if "padding_waste_fraction" in after:
        out["padding_waste_fraction"] = out.get("graph_padded_rows", 0) / rows if rows else 0.0
    return out


_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value)]} (comments skipped)."""
    out: dict[str, list[tuple[dict, float]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m or line.startswith("#"):
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return out


def graph_metrics(text: str) -> dict:
    """The graph counters of /metrics (daemon/metrics.py), as the runner's stats name them."""
    m = parse_metrics(text)
    total = lambda name: sum(v for _, v in m.get(name, ()))  # noqa: E731
    by = lambda name, label: {labels.get(label, ""): v for labels, v in m.get(name, ())}  # noqa: E731
    return {"graph_steps": total("tokenloom:graph_steps_total"),
            "replays": total("tokenloom:graph_replays_total"),
            "eager_steps": total("tokenloom:eager_steps_total"),
            "eager_reasons": by("tokenloom:eager_steps_total", "reason"),
            "graph_padded_rows": total("tokenloom:graph_padding_rows_total"),
            "decode_batch_size_histogram": by("tokenloom:decode_batch_size_total", "size"),
            "present": "tokenloom:graph_steps_total" in m}


def step_time_metrics(text: str) -> dict[str, float]:
    """The server's mean step time by part (forward, host, exposed_host, kv_round_trip; ms
    over its last steps): where a missed busy target went."""
    return {labels.get("part", ""): v
            for labels, v in parse_metrics(text).get("tokenloom:step_time_ms", ())}


class BusySampler:
    """Calls `probe()` (percent busy, e.g. torch.cuda.utilization) every `interval` seconds
    on a thread between start() and stop(); stop() returns the mean as a fraction and the
    sample count, or `available: False` with the reason the probe failed (no NVML on CPU)."""

    def __init__(self, probe, interval: float):
        self.probe, self.interval = probe, interval
        self.samples: list[float] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(float(self.probe()))
            except Exception as e:   # no driver, no nvidia-ml-py, not an NVIDIA device
                self.error = f"{type(e).__name__}: {e}"
                return
            self._stop.wait(self.interval)

    def start(self) -> "BusySampler":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(timeout=10)
        out = {"source": "nvml", "interval_s": self.interval, "samples": len(self.samples),
               "window_s": time.perf_counter() - self._t0}
        if self.error is not None or not self.samples:
            return {**out, "available": False, "fraction": None,
                    "reason": self.error or "no sample taken"}
        return {**out, "available": True, "fraction": sum(self.samples) / len(self.samples) / 100,
                "min": min(self.samples) / 100, "max": max(self.samples) / 100}


def nvml_probe(device: str):
    import torch

    if device != "cuda":
        def unavailable():
            raise RuntimeError(f"no NVML on device {device!r}")
        return unavailable
    return lambda: torch.cuda.utilization(0)   # index 0 of CUDA_VISIBLE_DEVICES, as the server's


# -- the profiler --------------------------------------------------------------------------
def _profiled_intervals(prof, device: str) -> list[tuple[float, float]]:
    """(start, end) in seconds of every device activity (CUDA: kernels, copies, memsets) or,
    on CPU, of every recorded op; from kineto's events, else from the Chrome trace."""
    import torch

    want = torch.autograd.DeviceType.CUDA if device == "cuda" else torch.autograd.DeviceType.CPU
    try:
        events = prof.profiler.kineto_results.events()
        return [(e.start_ns() / 1e9, (e.start_ns() + e.duration_ns()) / 1e9)
                for e in events if e.device_type() == want and e.duration_ns() > 0]
    except AttributeError:   # another torch's event API: read the exported trace instead
        import json
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            trace = json.load(open(f.name))
        cats = {"kernel", "gpu_memcpy", "gpu_memset"} if device == "cuda" else {"cpu_op"}
        return [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                for e in trace.get("traceEvents", ())
                if e.get("ph") == "X" and e.get("cat") in cats and e.get("dur", 0) > 0]


def profiled_busy(fn, device: str):
    """Run `fn()` under torch.profiler: (its result, busy stats). CUDA: the union of device
    activity over the wall time of the call (ending with a synchronize); CPU: of recorded
    ops on any thread (a smoke value: the dry run checks the code path, not the number)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    intervals = _profiled_intervals(prof, device)
    busy = union_seconds(intervals)
    return out, {"source": f"torch.profiler ({'cuda' if device == 'cuda' else 'cpu ops'})",
                 "events": len(intervals), "wall_s": wall, "busy_s": busy,
                 "fraction": busy / wall if wall > 0 else None}


# -- the steps --------------------------------------------------------------------------------
def runner_graph_stats(llm) -> dict:
    """The model runner's graph statistics (actors/execution/model_runner.py `graph_stats`)."""
    import msgspec
    return msgspec.structs.asdict(llm.graph_stats())


def cold_cache(llm) -> None:
    """Empty the prefix cache, so that both timed calls of the same prompts do the same
    work (only the shared prefix is reused, within the call)."""
    llm.wait_for_idle(timeout=30)
    refused = llm.flush_cache().refused_reason
    assert refused is None, f"prefix cache flush refused: {refused}"


def llm_options(plan: EnginePlan, cache_dir: Path, dtype: str) -> dict:
    return dict(quiet=True, device=plan.device, dtype=dtype, cache_dir=str(cache_dir),
                max_num_seqs=plan.max_num_seqs, num_blocks=plan.num_blocks,
                attention_backend=plan.attention_backend)


def offline_step(plan: EnginePlan, model_dir: Path, cache_dir: Path, spec) -> dict:
    from tokenloom import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), **llm_options(plan, cache_dir, plan.dtype))
    out = {"startup_s": time.perf_counter() - t0, "backend": llm.engine.info.attention_backend}
    try:
        prompts = make_prompts(plan.num_prompts, plan.prompt_len, plan.shared_prefix_len,
                               spec.vocab_size, seed=0)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))   # warm-up
        params = SamplingParams(temperature=0, max_tokens=plan.output_len, ignore_eos=True)
        cold_cache(llm)
        before = runner_graph_stats(llm)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t1
        after = runner_graph_stats(llm)
        # Again under the profiler, for the busy fraction (tokens/s above is free of its
        # overhead). A profiler that cannot start costs the number, not the step.
        try:
            cold_cache(llm)
            _, busy = profiled_busy(lambda: llm.generate(prompts, params), plan.device)
        except Exception as e:
            busy = {"source": "torch.profiler", "fraction": None, "error": repr(e)}
    finally:
        llm.close()
        llm = None   # not `del`: the profiled lambda above closes over the name
        _release_memory()
    tokens = sum(len(o.token_ids) for o in outs)
    return {**out, "prompts": len(prompts), "prompt_len": plan.prompt_len,
            "shared_prefix_len": plan.shared_prefix_len, "output_len": plan.output_len,
            "output_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "complete": all(len(o.token_ids) == plan.output_len for o in outs),
            "busy": busy, "graphs": stats_delta(before, after), "graphs_total": after}


def parity_step(plan: EnginePlan, workdir: Path, cache_dir: Path) -> dict:
    """Greedy through LLM against transformers on the same device, tiny random fp32 model
    (std 0.3, as tests/tinymodel.py, so that the top logits are well separated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenloom import LLM, SamplingParams
    from tokenloom.kernels.models.random_model import SHAPES, write_checkpoint

    hf_greedy = _load_by_path("tokenloom_tinymodel", ROOT / "tests" / "tinymodel.py").hf_greedy
    spec = SHAPES["tiny"]
    model_dir = workdir / "parity-tiny"
    write_checkpoint(spec, model_dir, torch.float32, seed=1, std=0.3)
    rng = random.Random(1)
    prompts = [[rng.randrange(FIRST_WORD_ID, spec.vocab_size) for _ in range(n)]
               for n in plan.parity_prompt_lens]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(plan.device).eval()
    expected = [hf_greedy(hf, p, plan.parity_tokens) for p in prompts]
    del hf
    _release_memory()
    llm = LLM(model=str(model_dir), **{**llm_options(plan, cache_dir, "float32"),
                                         "max_num_seqs": 8, "num_blocks": 128})
    try:
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(
            temperature=0, max_tokens=plan.parity_tokens, ignore_eos=True))]
        stats = runner_graph_stats(llm)
        backend = llm.engine.info.attention_backend
    finally:
        llm.close()
        del llm
        _release_memory()
    mismatches = [{"prompt": i, "expected": e, "got": g}
                  for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    return {"prompts": len(prompts), "tokens": plan.parity_tokens, "backend": backend,
            "matched": len(prompts) - len(mismatches), "mismatches": mismatches[:3],
            "graph_replays": stats.get("replays", 0), "graph_steps": stats.get("graph_steps", 0)}


def server_command(plan: EnginePlan, model_dir: Path, cache_dir: Path, port: int,
                   socket_path: Path) -> list[str]:
    sets = {"model.device": plan.device, "model.dtype": plan.dtype,
            "model.cache_dir": str(cache_dir), "model.attention_backend": plan.attention_backend,
            "cache.num_blocks": plan.num_blocks,
            "scheduler.max_num_seqs": plan.max_num_seqs, "admin.socket_path": str(socket_path)}
    cmd = [sys.executable, "-m", "tokenloom.daemon", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(model_dir)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}" if not isinstance(value, str) else f'{key}="{value}"']
    return cmd


def server_env(pythonpath: str) -> dict:
    """This process's environment with `pythonpath` (the checkout's import root and the
    carried wheels) in front, so the server imports the same tokenloom and modules."""
    parts = [p for p in pythonpath.split(os.pathsep) if p]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(parts)}


def log_tail(path: Path, lines: int = 60, head: bool = False) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text[:lines] if head else text[-lines:])


async def _fetch_text(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(url) as r:
            return await r.text()


async def timed_load(h, url: str, model: str, prompts, output_len: int, streams: int,
                     seconds: float) -> tuple[list, float]:
    """`streams` workers send streaming completions back to back (the harness's client), each
    starting new requests until `seconds` have passed; returns (results, elapsed)."""
    conns = h.Connections(url)
    gc.collect()
    gc.freeze()   # as harness.run_load: no full collection stalls the streams mid-run
    results: list = []
    t0 = time.perf_counter()
    deadline = t0 + seconds

    async def worker(k: int):
        i = k
        while time.perf_counter() < deadline:
            results.append(await h.one_request(conns, model, prompts[i % len(prompts)],
                                               output_len))
            i += streams

    try:
        await asyncio.gather(*(worker(k) for k in range(streams)))
    finally:
        conns.close()
        gc.unfreeze()
    return results, time.perf_counter() - t0


async def _http_session(plan: EnginePlan, h, url: str, spec) -> dict:
    model = await h.model_name(url)
    prompts = make_prompts(4 * plan.http_streams, plan.prompt_len, plan.shared_prefix_len,
                           spec.vocab_size, seed=1)
    await h.run_load(url, model, prompts[:plan.http_streams], 4, plan.http_streams, 0, 0)
    before = graph_metrics(await _fetch_text(url + "/metrics"))
    sampler = BusySampler(nvml_probe(plan.device), plan.busy_interval_s).start()

    async def sample_steady_state():
        # Until the last request starts: the drain after it (streams ending one by one)
        # is not the 64-stream load the target is about.
        await asyncio.sleep(plan.http_seconds)
        return await asyncio.to_thread(sampler.stop)

    busy_task = asyncio.create_task(sample_steady_state())
    results, elapsed = await timed_load(h, url, model, prompts, plan.http_output_len,
                                        plan.http_streams, plan.http_seconds)
    busy = await busy_task
    text = await _fetch_text(url + "/metrics")
    after = graph_metrics(text)
    return {"model": model, "load": h.summarise(results, elapsed), "gpu_busy": busy,
            "graphs": stats_delta(before, after), "graphs_total": after,
            "step_time_ms": step_time_metrics(text)}


def http_step(plan: EnginePlan, model_dir: Path, cache_dir: Path, workdir: Path,
              pythonpath: str, spec) -> dict:
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"`tokenloom serve` needs {', '.join(missing)}, not importable "
                           f"here: carry it as a wheel (`make gpu-wheels`)")
    h = bench_harness()
    port = h.free_port()
    log_path = workdir / "server.log"
    log_path.write_text("")
    cmd = server_command(plan, model_dir, cache_dir, port, workdir / "admin.sock")
    out: dict = {"command": " ".join(cmd), "streams": plan.http_streams,
                 "seconds": plan.http_seconds, "output_len": plan.http_output_len}
    t0 = time.perf_counter()
    server = None
    try:
        server = h.Server("the server", cmd, f"http://127.0.0.1:{port}", "/ready",
                          timeout=plan.server_timeout_s, log_path=log_path, cwd=workdir,
                          env=server_env(pythonpath))
        out["startup_s"] = time.perf_counter() - t0
        out.update(h.run_async(_http_session(plan, h, server.url, spec)))
    except Exception as e:
        out["error"] = traceback.format_exc()
        out["exit_code"] = getattr(e, "returncode", None)
    finally:
        if server is not None:
            out["exit_code"] = server.stop()
        out["log_head"] = log_tail(log_path, 40, head=True)   # start-up: kernels, capture, KV
        if "error" in out or out["exit_code"] != 0:
            out["log_tail"] = log_tail(log_path)
    return out


def _release_memory() -> None:
    gc.collect()
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def _step(result: dict, name: str, fn) -> None:
    print(f"== engine: {name}", flush=True)
    t0 = time.perf_counter()
    try:
        result[name] = fn()
    except Exception:
        result[name] = {"error": traceback.format_exc()}
        print(result[name]["error"], file=sys.stderr)
    result[name]["step_s"] = time.perf_counter() - t0


def run(plan: EnginePlan, pythonpath: str) -> dict:
    """Every step of the engine part (see the module docstring), in a temporary directory."""
    import tempfile

    import torch

    from tokenloom.kernels.models.random_model import SHAPES, write_checkpoint

    spec = SHAPES[plan.shape]
    workdir = Path(tempfile.mkdtemp(prefix="tokenloom-engine-"))
    result: dict = {"plan": dataclasses.asdict(plan), "workdir": str(workdir)}
    model_dir, cache_dir = workdir / plan.shape, workdir / "cache"
    try:
        _step(result, "checkpoint", lambda: _write(write_checkpoint, spec, model_dir,
                                                   getattr(torch, plan.dtype)))
        if "error" not in result["checkpoint"]:
            _step(result, "offline", lambda: offline_step(plan, model_dir, cache_dir, spec))
        _step(result, "parity", lambda: parity_step(plan, workdir, cache_dir))
        if "error" not in result["checkpoint"]:
            _step(result, "http", lambda: http_step(plan, model_dir, cache_dir, workdir,
                                                    pythonpath, spec))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _write(write_checkpoint, spec, model_dir: Path, dtype) -> dict:
    t0 = time.perf_counter()
    write_checkpoint(spec, model_dir, dtype, seed=0)
    size = sum(f.stat().st_size for f in model_dir.iterdir())
    return {"seconds": time.perf_counter() - t0, "bytes": size}


# -- verdicts and the table ---------------------------------------------------------------------
def failures(engine: dict, on_gpu: bool) -> list[str]:
    """Why the engine part fails: a step that raised, a parity miss, an incomplete or
    erroring HTTP load, a server that did not stop cleanly; on the GPU also zero graph
    replays (offline or over HTTP) or decode attention off Triton. The busy target is
    checked with gpu_check's targets."""
    out = []
    for name in ("checkpoint", "offline", "parity", "http"):
        step = engine.get(name)
        if step is None:
            out.append(f"engine {name}: did not run")
        elif "error" in step:
            out.append(f"engine {name} raised: {step['error'].strip().splitlines()[-1]}")
    off = engine.get("offline", {})
    if "error" not in off and off:
        if not off.get("complete"):
            out.append("engine offline: some outputs are shorter than max_tokens (ignore_eos)")
        if on_gpu and off.get("graphs", {}).get("replays", 0) == 0:
            out.append(f"engine offline: no CUDA graph was replayed ({off.get('graphs')})")
        if on_gpu and off.get("backend") != "triton":   # auto: Triton unless its smoke test failed
            out.append(f"engine offline: decode attention ran on {off.get('backend')!r}, not "
                       f"Triton (the start-up smoke test's warning says why)")
    par = engine.get("parity", {})
    if "error" not in par and par and par.get("matched") != par.get("prompts"):
        out.append(f"engine parity: {par['prompts'] - par['matched']} of {par['prompts']} "
                   f"greedy outputs differ from transformers, e.g. {par['mismatches'][:1]}")
    http = engine.get("http", {})
    if http and "load" in http:
        load = http["load"]
        if load["errors"] or not load["requests"]:
            out.append(f"engine http: {load['errors']} of {load['requests']} requests failed "
                       f"({load.get('first_error')})")
        if on_gpu and http.get("graphs", {}).get("replays", 0) == 0:
            out.append("engine http: no CUDA graph was replayed during the load (/metrics)")
    if http and http.get("exit_code") not in (None, 0):
        out.append(f"engine http: the server exited with {http['exit_code']} after SIGTERM")
    return out


def print_tables(engine: dict) -> None:
    plan = engine.get("plan", {})
    print(f"\nengine ({plan.get('shape')}, {plan.get('dtype')}, {plan.get('device')}, "
          f"random weights):")
    off = engine.get("offline", {})
    if "tokens_per_s" in off:
        g = off["graphs"]
        print(f"  offline: {off['prompts']} prompts x {off['output_len']} tokens "
              f"({off['shared_prefix_len']}/{off['prompt_len']} prompt tokens shared by half): "
              f"{off['tokens_per_s']:.0f} tok/s, start-up {off['startup_s']:.1f}s, "
              f"busy {_pct(off['busy'].get('fraction'))} ({off['busy']['source']})")
        piecewise = (f", {g['piecewise_steps']} piecewise" if g.get("piecewise_steps") else "")
        print(f"  offline graphs: {g.get('graph_steps', 0)} graph steps, {g.get('replays', 0)} "
              f"replays{piecewise}, {g.get('eager_steps', 0)} eager {g.get('eager_reasons', {})}, "
              f"padding waste {_pct(g.get('padding_waste_fraction'))}")
    par = engine.get("parity", {})
    if "matched" in par:
        print(f"  parity vs transformers (tiny, fp32, {par['backend']}): {par['matched']}/"
              f"{par['prompts']} prompts x {par['tokens']} tokens identical, "
              f"{par['graph_replays']} graph replays")
    http = engine.get("http", {})
    if "load" in http:
        s, busy, g = http["load"], http["gpu_busy"], http["graphs"]
        ms = lambda d: "/".join("-" if d[k] is None else f"{d[k]:.1f}"  # noqa: E731
                                for k in ("p50", "p90", "p99"))
        print(f"  http: {http['streams']} streams x {http['output_len']} tokens for "
              f"{s['elapsed_s']:.1f}s: {s['requests']} requests, {s['errors']} errors, "
              f"{s['output_tokens_per_s']:.0f} tok/s; TTFT p50/p90/p99 {ms(s['ttft_ms'])} ms, "
              f"ITL {ms(s['itl_ms'])} ms; start-up {http['startup_s']:.1f}s")
        busy_text = (f"{_pct(busy['fraction'])} ({busy['samples']} NVML samples)"
                     if busy.get("available") else f"unavailable ({busy.get('reason')})")
        steps = http.get("step_time_ms") or {}
        if steps:
            print("  http server step time (ms, mean of its last steps): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()))
        print(f"  http GPU busy: {busy_text}; graphs over the load: {g.get('graph_steps', 0):.0f} "
              f"graph steps, {g.get('replays', 0):.0f} replays, {g.get('eager_steps', 0):.0f} "
              f"eager {g.get('eager_reasons', {})}")
    for name in ("checkpoint", "offline", "parity", "http"):
        if "error" in engine.get(name, {}):
            print(f"  {name}: ERROR {engine[name]['error'].strip().splitlines()[-1]}")
    if http.get("log_tail"):
        print("  server log tail:\n    " + http["log_tail"].replace("\n", "\n    "))


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"
