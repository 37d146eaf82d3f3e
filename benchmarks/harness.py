"""What every benchmark script shares, written once.

- servers: `start_tokenloom` (`tokenloom serve` on a free port, ready when /ready is 200),
  the peers `start_llama_server` (llama.cpp, built by shared/peers/build-llama-server.sh) and
  `start_transformers`, each a `Server` whose `stop()` sends SIGTERM and returns the status;
- models: `build_tiny_vocab_model` (a 2-layer random Llama with the default model's
  tokenizer), `resolve_dir` (the default model's converted directory), `tests_module`
  (tests/tinymodel.py and its word-level tiny models);
- the load generator: `run_load` (closed loop at a concurrency, or Poisson arrivals) over
  `Connections`, keep-alive connections whose `SSEStream` protocol reads a streamed
  completion with as little Python as possible; `PeerStream` reads llama-server's;
- numbers: `percentile` (the one implementation), `summarise` (TTFT / ITL / end-to-end
  percentiles and tokens/s of a run), `print_table`, `summary_row` (a run as one row of a
  record's table, under SUMMARY_COLUMNS), `write_json`.

Scripts import it as `from harness import ...` (Python puts a script's folder first on
sys.path); gpu_engine.py loads it by path on a GPU host where nothing is installed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np

# Where shared/peers/build-llama-server.sh puts llama-server and the GGUFs.
PEERS = Path(os.environ.get("TOKENLOOM_PEERS", Path.home() / ".cache" / "tokenloom-peers"))
VOCAB_LO, VOCAB_HI = 1000, 20000   # ordinary tokens of the default vocabulary, no special ones


ROOT = Path(__file__).resolve().parents[1]


def tests_module(name: str):
    """tests/<name>.py (e.g. tinymodel, the tiny random models of the test suite), imported by
    path: tests/ is not a package, and nothing is added to sys.path."""
    import importlib.util

    key = f"tokenloom_tests_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "tests" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module    # before exec: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[key]


def run_async(coro):
    """asyncio.run on uvloop (a dependency of the server): the load generator shares the
    cores it measures, so its own event loop should cost as little as the server's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- numbers -------------------------------------------------------------------------------
def percentile(xs, q: float, scale: float = 1.0) -> float | None:
    """The `q`-th percentile of `xs` (numpy's linear interpolation) times `scale`; None for
    no samples."""
    if len(xs) == 0:
        return None
    return float(np.percentile(xs, q)) * scale


def ms_per_call(fn, n: int) -> float:
    """Mean milliseconds of `fn()` over `n` calls, after one untimed warm-up call."""
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1000


def write_json(path: str | Path, obj, indent: int = 2, **kw) -> Path:
    """`obj` as JSON at `path` (folders made); `kw` goes to json.dumps. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, **kw))
    return path


# -- servers -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_200(proc: subprocess.Popen, url: str, timeout: float) -> str | None:
    """Poll `url` until it answers 200: None, or why it never did (the server exited, or
    `timeout` seconds passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with status {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return None
        except OSError:
            pass
        time.sleep(0.2)
    return f"did not answer 200 within {timeout:.0f} s"


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM (a tokenloom server drains, then exits 0), SIGKILL if it does not exit within
    `timeout`; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


class ServerError(RuntimeError):
    """A server that never became ready; `returncode` is its exit status once stopped."""

    def __init__(self, message: str, returncode: int | None):
        super().__init__(message)
        self.returncode = returncode


class Server:
    """A server subprocess on 127.0.0.1, started by the constructor: it returns once `url` +
    `ready_path` answers 200, else stops the process and raises ServerError naming `name`,
    the reason and the log. Output goes to `log_path` (appended) or nowhere."""

    def __init__(self, name: str, cmd: list[str], url: str, ready_path: str, *,
                 timeout: float = 600, log_path: Path | None = None, env: dict | None = None,
                 cwd: str | Path | None = None):
        self.name, self.cmd, self.url, self.log_path = name, cmd, url, log_path
        if log_path is not None:
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, cwd=cwd)
        else:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env, cwd=cwd)
        problem = wait_for_200(self.proc, url + ready_path, timeout)
        if problem is not None:
            code = self.stop()
            where = f"; see {log_path}" if log_path is not None else ""
            raise ServerError(f"{name} {problem}{where}", code)

    def stop(self, timeout: float = 60.0) -> int:
        return stop(self.proc, timeout)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def tokenloom_command(model: str, port: int, settings=(), *, args=(), command=None) -> list[str]:
    """`tokenloom serve` on 127.0.0.1:`port` with request logging off (it would cost CPU),
    `settings` (KEY=VALUE strings) as --set overrides and `args` (e.g. --workers 2) after
    them. `command` replaces the executable (e.g. `[sys.executable, "-m", "tokenloom.daemon"]`
    where nothing is installed)."""
    exe = list(command) if command else [str(Path(sys.executable).with_name("tokenloom"))]
    cmd = [*exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--model", model,
           "--set", "server.log_level=warning"]
    for item in settings:
        cmd += ["--set", item]
    return cmd + list(args)


def start_tokenloom(model: str, settings=(), *, args=(), command=None, timeout: float = 600,
                    log_path: Path | None = None, env: dict | None = None,
                    cwd: str | Path | None = None) -> Server:
    """The one way the benchmarks run `tokenloom serve`: a free port, ready at /ready."""
    port = free_port()
    cmd = tokenloom_command(model, port, settings, args=args, command=command)
    return Server("the server", cmd, f"http://127.0.0.1:{port}", "/ready", timeout=timeout,
                  log_path=log_path, env=env, cwd=cwd)


def start_llama_server(binary: Path, gguf: Path, slots: int, ctx: int, threads: int,
                       log_path: Path, extra=()) -> Server:
    """llama.cpp's llama-server with `slots` parallel slots sharing one `ctx`-token KV cache
    (continuous batching, prompt cache on); ready when /health is 200 (503 while the model
    loads). `extra`: more flags (e.g. the KV cache type, -ctk q8_0)."""
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-np", str(slots), "-c", str(ctx), "--kv-unified",
           "--cont-batching", "--no-webui", *extra]
    return Server("llama-server", cmd, f"http://127.0.0.1:{port}", "/health", timeout=300,
                  log_path=log_path)


def start_vllm_cpu(venv: Path, model_dir: str, log_path: Path, dtype: str = "bfloat16",
                   max_model_len: int = 8192) -> Server:
    """vLLM's own CPU build (installed by ../shared/peers/install-vllm-cpu.sh into `venv`),
    with the settings that script prints: tcmalloc and Intel OpenMP preloaded, the OpenMP
    threads bound one per core, prefix caching and chunked prefill on (vLLM's defaults).
    Ready when /health is 200; start-up compiles for ~100 s."""
    import glob
    import os

    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}")
    preload = [p for p in ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                           *glob.glob(f"{venv}/**/libiomp5.so", recursive=True)[:1]]
               if Path(p).is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    cmd = [str(Path(venv) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", model_dir, "--served-model-name", Path(model_dir).name,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(max_model_len)]
    return Server("vLLM CPU", cmd, f"http://127.0.0.1:{port}", "/health", timeout=900,
                  log_path=log_path, env=env)


def start_transformers(model_dir: str) -> Server:
    """`transformers serve --continuous-batching` (needs transformers[serving])."""
    port = free_port()
    exe = str(Path(sys.executable).with_name("transformers"))
    cmd = [exe, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
           model_dir]
    return Server("transformers serve", cmd, f"http://127.0.0.1:{port}", "/health")


# -- models --------------------------------------------------------------------------------
def build_tiny_vocab_model(path: Path, default_dir: Path) -> None:
    """A 2-layer random Llama with the default model's tokenizer and vocabulary, so that
    compute is negligible and a run measures serving overhead. (tests/tinymodel.py's
    build_tiny_model is another thing: a word-level vocabulary of 256.)"""
    import shutil

    import torch
    import transformers

    src = json.loads((default_dir / "config.json").read_text())
    cfg = transformers.LlamaConfig(vocab_size=src["vocab_size"], hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, tie_word_embeddings=True,
                                   bos_token_id=src.get("bos_token_id"),
                                   eos_token_id=src.get("eos_token_id"))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for f in default_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)


def resolve_dir(model: str) -> str:
    """`model` as a directory: "default" is the default model's converted copy."""
    if model != "default":
        return model
    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    from tokenloom.kernels.models.loader import resolve_model_dir

    return str(resolve_model_dir("default", resolve_cache_dir(ModelConfig())))


def text_prompts(url: str, prompts: list[list[int]]) -> list[str]:
    """Token-id prompts as text, through the server's /detokenize."""
    import aiohttp

    async def convert():
        async with aiohttp.ClientSession() as s:
            out = []
            for ids in prompts:
                async with s.post(url + "/detokenize", json={"tokens": ids}) as r:
                    out.append((await r.json())["prompt"])
            return out
    return run_async(convert())


async def model_name(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            return (await r.json())["data"][0]["id"]


# -- the load ------------------------------------------------------------------------------
class SSEStream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that sends a streaming POST and reads the response
    (chunked or Content-Length) with as little Python as possible: the load generator shares
    the cores it measures, and an aiohttp client costs ~3x more per SSE chunk than this.

    `post()` resolves to (status, chunk arrival times, usage or None, error body or None)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.reusable = False
        self._done: asyncio.Future | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.reusable = False
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionError(f"connection lost mid-response: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._raw += data
        if self._status is None and not self._parse_head():
            return
        if self._length is not None:  # a plain (error) body
            if len(self._raw) >= self._length:
                self._finish(bytes(self._raw[: self._length]).decode(errors="replace"))
            return
        self._parse_chunks(now)

    # -- one request -------------------------------------------------------------------------
    def post(self, request: bytes) -> asyncio.Future:
        self._done = asyncio.get_running_loop().create_future()
        self._raw = bytearray()
        self._status, self._length, self._close = None, None, False
        self._sse = b""
        self._times: list[float] = []
        self._usage: dict | None = None
        self.reusable = False
        self.transport.write(request)
        return self._done

    def _parse_head(self) -> bool:
        end = self._raw.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self._raw[:end]).decode("latin-1").split("\r\n")
        del self._raw[: end + 4]
        self._status = int(head[0].split(" ", 2)[1])
        chunked = False
        for line in head[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "content-length":
                self._length = int(value)
            elif name == "connection" and value == "close":
                self._close = True
        if chunked:
            self._length = None
        elif self._length is None:
            raise RuntimeError("the response has neither chunked encoding nor a length")
        return True

    def _parse_chunks(self, now: float) -> None:
        raw, pos = self._raw, 0
        while True:
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(bytes(raw[pos:eol]).split(b";", 1)[0], 16)
            if size == 0:
                if len(raw) < eol + 4:
                    break
                del raw[:]
                self._finish(None if self._status == 200 else self._sse.decode(errors="replace"))
                return
            if len(raw) < eol + 2 + size + 2:
                break
            self._feed(bytes(raw[eol + 2: eol + 2 + size]), now)
            pos = eol + 2 + size + 2
        del raw[:pos]

    def _feed(self, data: bytes, now: float) -> None:
        if self._status != 200:  # an error body, whole
            self._sse += data
            return
        *frames, self._sse = (self._sse + data).split(b"\n\n")
        for frame in frames:
            payload = frame[len(b"data: "):]
            # Parse JSON only where needed. A compact `"choices":[{` can only be structure
            # (quotes inside text are escaped), so such a frame is a content chunk; anything
            # else (the usage chunk, errors, other servers' spacing) is decoded.
            if b'"choices":[{' in payload:
                self._times.append(now)
            elif payload != b"[DONE]" and payload:
                event = json.loads(payload)
                if event.get("choices"):
                    self._times.append(now)
                elif event.get("usage"):
                    self._usage = event["usage"]

    def _finish(self, error_body: str | None) -> None:
        self.reusable = not self._close
        if not self._done.done():
            self._done.set_result((self._status, self._times, self._usage, error_body))


class PeerStream(SSEStream):
    """The SSE reader for llama-server: its last frame carries an empty-text choice *and*
    the usage, which must not count as a token (nor hide the usage). A frame with a usage
    object is decoded; it counts as a token only if it has text. llama-server also closes
    the connection after a streamed response although it announces keep-alive, so every
    request gets a fresh connection."""

    def _finish(self, error_body: str | None) -> None:
        super()._finish(error_body)
        self.reusable = False

    def _feed(self, data: bytes, now: float) -> None:
        if self._status != 200:
            self._sse += data
            return
        *frames, self._sse = (self._sse + data).split(b"\n\n")
        for frame in frames:
            payload = frame[len(b"data: "):]
            if b'"usage":{' in payload:
                event = json.loads(payload)
                if any(c.get("text") for c in event.get("choices") or ()):
                    self._times.append(now)
                self._usage = event["usage"]
            elif b'"choices":[{' in payload:
                self._times.append(now)
            elif payload != b"[DONE]" and payload:
                event = json.loads(payload)
                if event.get("choices"):
                    self._times.append(now)


class Connections:
    """Idle keep-alive connections to one server, opened on demand."""

    def __init__(self, url: str, protocol: type | None = None):
        self.protocol = protocol or SSEStream  # a subclass parses another server's SSE
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._idle: list[SSEStream] = []

    async def post(self, path: str, body: bytes):
        conn = self._idle.pop() if self._idle else None
        if conn is None:
            _, conn = await asyncio.get_running_loop().create_connection(
                self.protocol, self.host, self.port)
        request = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                   f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        try:
            return await conn.post(request)
        finally:
            if conn.reusable:
                self._idle.append(conn)
            elif conn.transport is not None:
                conn.transport.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.transport.close()
        self._idle.clear()


async def one_request(conns: Connections, model, prompt, output_len, tokenloom=True) -> dict:
    """`prompt`: token ids or text; or (model, prompt, extra body fields) to give each
    request its own model (e.g. a LoRA adapter) and fields (llama-server's `lora`)."""
    extra = {}
    if isinstance(prompt, tuple):
        model, prompt, extra = prompt
    body = dict(model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
                stream_options={"include_usage": True}, **extra)
    if tokenloom:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    status, chunk_times, usage, error = await conns.post("/v1/completions",
                                                         json.dumps(body).encode())
    end = time.perf_counter()
    if status != 200:
        return {"error": f"{status} {error}"}
    tokens, cached = 0, None
    if usage:
        tokens = usage["completion_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    tokens = tokens or len(chunk_times)  # no usage chunk: one token per chunk
    return {"ttft": chunk_times[0] - t0 if chunk_times else None,
            "itl": list(np.diff(chunk_times)), "e2e": end - t0, "tokens": tokens,
            "cached_tokens": cached}


async def run_load(url, model, prompts, output_len, concurrency, rate, seed,
                   tokenloom=True, protocol: type | None = None) -> tuple[list, float]:
    rng = random.Random(seed)
    conns = Connections(url, protocol)
    # This process may hold torch and transformers (--tiny, --offline): without this, a full
    # collection walks all their objects, stalling every stream for ~200 ms mid-run.
    gc.collect()
    gc.freeze()
    try:
        return await _closed_or_open_loop(conns, model, prompts, output_len, concurrency,
                                          rate, rng, tokenloom)
    finally:
        conns.close()


async def _closed_or_open_loop(conns, model, prompts, output_len, concurrency, rate, rng,
                               tokenloom) -> tuple[list, float]:
    t0 = time.perf_counter()
    if rate:
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(conns, model, p, output_len,
                                                         tokenloom)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    else:
        queue = list(reversed(prompts))
        results = []

        async def worker():
            while queue:
                results.append(await one_request(conns, model, queue.pop(), output_len,
                                                 tokenloom))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def summarise(results: list, elapsed: float) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    out = {"requests": len(results), "errors": len(errors), "elapsed_s": elapsed,
           "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
           "requests_per_s": len(ok) / elapsed}
    for name, xs in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        out[name] = {"p50": percentile(xs, 50, 1000), "p90": percentile(xs, 90, 1000),
                     "p99": percentile(xs, 99, 1000),
                     "mean": float(np.mean(xs)) * 1000 if xs else None}
    if errors:
        out["first_error"] = errors[0]
    # Prefix-cache split: requests that reused cached blocks vs those that did not.
    for name, group in (("hit", [r for r in ok if r.get("cached_tokens")]),
                        ("miss", [r for r in ok if not r.get("cached_tokens")])):
        xs = [r["ttft"] for r in group if r["ttft"] is not None]
        out[f"ttft_{name}_ms"] = {"n": len(xs), "p50": percentile(xs, 50, 1000),
                                  "p99": percentile(xs, 99, 1000)}
    return out


SUMMARY_COLUMNS = ["run", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                   "ITL p99 ms", "e2e p50 ms", "errors"]


def summary_row(label: str, s: dict) -> list:
    """A `summarise` result as one row under SUMMARY_COLUMNS (a record's table)."""
    return [label, s["output_tokens_per_s"], s["requests_per_s"], s["ttft_ms"]["p50"],
            s["ttft_ms"]["p99"], s["itl_ms"]["p50"], s["itl_ms"]["p99"], s["e2e_ms"]["p50"],
            s["errors"]]


def print_table(label: str, s: dict) -> None:
    """A `summarise` result: the header line, then TTFT / ITL / e2e percentiles in ms."""
    print(f"\n{label}: {s['requests']} requests, {s['errors']} errors, {s['elapsed_s']:.2f} s, "
          f"{s['output_tokens_per_s']:.0f} output tok/s, {s['requests_per_s']:.2f} req/s")
    print(f"{'metric':<10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}   (ms)")
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        row = s[name]
        cells = "".join(f"{row[k]:>10.2f}" if row[k] is not None else f"{'-':>10}"
                        for k in ("p50", "p90", "p99", "mean"))
        print(f"{name[:-3]:<10}{cells}")
