"""HTTP load generator for `tokenloom serve`: TTFT, inter-token latency, end-to-end latency
(p50/p90/p99) and output tokens/s, printed as a table and written as JSON.

Workload: `--num-requests` streaming /v1/completions requests whose prompts are random token
ids of `--prompt-len` tokens, each generating exactly `--output-len` tokens (ignore_eos),
sent either at a fixed concurrency (`--concurrency N`) or as Poisson arrivals
(`--rate R` requests/s).

Server: `--url` benchmarks a running server; otherwise one is started as a subprocess
(`tokenloom serve --port 0`) with `--model` (default: the bundled model) or, with `--tiny`,
a tiny random-weight Llama with the default model's vocabulary, so that compute is negligible
and the number measures serving overhead (HTTP, SSE, actors, detokenization).
`--offline` also runs the same requests through the offline engine (`LLM.generate`) in this
process, after the server has stopped, and reports the HTTP/offline throughput ratio.
`--transformers` then runs the same workload against `transformers serve
--continuous-batching` (needs `pip install "transformers[serving]"`), one server after the
other, and reports the tokenloom/transformers throughput ratio. That server knows neither
token-id prompts nor ignore_eos, so in this mode both servers get the same text prompts
(random token ids decoded), and output tokens are counted as streamed.

    python benchmarks/serve.py --tiny --concurrency 64 --num-requests 256 --output-len 64
    python benchmarks/serve.py --concurrency 16 --prompt-len 256 --output-len 64 --offline
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np


def run_async(coro):
    """asyncio.run on uvloop (a dependency of the server): the load generator shares the
    cores it measures, so its own event loop should cost as little as the server's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- the server ----------------------------------------------------------------------------
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


def start_server(args, model: str) -> tuple[subprocess.Popen, str]:
    """`tokenloom serve` on a free port, with request logging off (it would cost CPU)."""
    port = free_port()
    exe = str(Path(sys.executable).with_name("tokenloom"))
    cmd = [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--model", model,
           "--set", "server.log_level=warning", *sum((["--set", s] for s in args.set), [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    problem = wait_for_200(proc, url + "/ready", 600)
    if problem is not None:
        proc.kill()
        raise SystemExit(f"the server {problem}")
    return proc, url


def build_tiny_model(path: Path, default_dir: Path) -> None:
    """A 2-layer random Llama with the default model's tokenizer and vocabulary."""
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
    if model != "default":
        return model
    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    from tokenloom.kernels.models.loader import resolve_model_dir

    return str(resolve_model_dir("default", resolve_cache_dir(ModelConfig())))


def text_prompts(url: str, prompts: list[list[int]]) -> list[str]:
    """Token-id prompts as text, through the server's /detokenize."""
    async def convert():
        async with aiohttp.ClientSession() as s:
            out = []
            for ids in prompts:
                async with s.post(url + "/detokenize", json={"tokens": ids}) as r:
                    out.append((await r.json())["prompt"])
            return out
    return run_async(convert())


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            return (await r.json())["data"][0]["id"]


# -- the load -------------------------------------------------------------------------------
def start_transformers(model_dir: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    exe = str(Path(sys.executable).with_name("transformers"))
    proc = subprocess.Popen([exe, "serve", "--continuous-batching", "--host", "127.0.0.1",
                             "--port", str(port), model_dir], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"transformers serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("transformers serve did not start")


class _Stream(asyncio.Protocol):
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


class _Connections:
    """Idle keep-alive connections to one server, opened on demand."""

    def __init__(self, url: str, protocol: type | None = None):
        self.protocol = protocol or _Stream  # a _Stream subclass parses another server's SSE
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._idle: list[_Stream] = []

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


async def one_request(conns: _Connections, model, prompt, output_len, tokenloom=True) -> dict:
    body = dict(model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
                stream_options={"include_usage": True})
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
    conns = _Connections(url, protocol)
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
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else None  # noqa: E731
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    out = {"requests": len(results), "errors": len(errors), "elapsed_s": elapsed,
           "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
           "requests_per_s": len(ok) / elapsed}
    for name, xs in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        out[name] = {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99),
                     "mean": float(np.mean(xs)) * 1000 if xs else None}
    if errors:
        out["first_error"] = errors[0]
    # Prefix-cache split: requests that reused cached blocks vs those that did not.
    for name, group in (("hit", [r for r in ok if r.get("cached_tokens")]),
                        ("miss", [r for r in ok if not r.get("cached_tokens")])):
        xs = [r["ttft"] for r in group if r["ttft"] is not None]
        out[f"ttft_{name}_ms"] = {"n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99)}
    return out


def run_offline(model: str, prompts, output_len: int, settings: list[str],
                concurrency: int) -> dict:
    """The same requests through LLM.generate, all submitted at once but with at most
    `concurrency` running (max_num_seqs), like the HTTP run's closed loop."""
    from tokenloom import LLM, SamplingParams

    options = {"scheduler.max_num_seqs": concurrency}
    for item in settings:
        key, _, value = item.partition("=")
        options[key] = json.loads(value) if value[:1].isdigit() else value.strip('"')
    llm = LLM(model=model, quiet=True, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    finally:
        llm.close()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


def print_table(label: str, s: dict) -> None:
    print(f"\n{label}: {s['requests']} requests, {s['errors']} errors, {s['elapsed_s']:.2f} s, "
          f"{s['output_tokens_per_s']:.0f} output tok/s, {s['requests_per_s']:.2f} req/s")
    print(f"{'metric':<10}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}   (ms)")
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        row = s[name]
        cells = "".join(f"{row[k]:>10.2f}" if row[k] is not None else f"{'-':>10}"
                        for k in ("p50", "p90", "p99", "mean"))
        print(f"{name[:-3]:<10}{cells}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="benchmark this running server instead of starting one")
    p.add_argument("--model", default="default")
    p.add_argument("--tiny", action="store_true",
                   help="serve a tiny random Llama with the default vocabulary")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the started server (and --offline)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--offline", action="store_true", help="also run the offline engine")
    p.add_argument("--transformers", action="store_true",
                   help="also run `transformers serve --continuous-batching`")
    p.add_argument("--json", default="benchmarks/results/serve.json")
    p.add_argument("--shared-prefix", action="store_true",
                   help="prefix-cache workload: groups of requests sharing a long prefix, run "
                        "with caching on and then off (defaults below unless given)")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--interference", action="store_true",
                   help="long-prompt interference workload, static vs SLO chunking "
                        "(see benchmarks/interference.py)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    args = p.parse_args()
    if args.shared_prefix:
        return shared_prefix_main(args)
    if args.interference:
        return interference(args)

    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    model = args.model
    tmp = None
    if args.tiny:
        from tokenloom.config.schema import ModelConfig, resolve_cache_dir
        from tokenloom.kernels.models.loader import resolve_model_dir

        tmp = tempfile.TemporaryDirectory()
        default_dir = resolve_model_dir("default", resolve_cache_dir(ModelConfig()))
        build_tiny_model(Path(tmp.name), default_dir)
        model = tmp.name
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args, model)
    try:
        name = run_async(model_name(url))
        rng = random.Random(args.seed)
        # Ids from the middle of the vocabulary: ordinary tokens, no special ones.
        prompts = [[rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        if args.transformers:
            prompts = text_prompts(url, prompts)
        run_async(run_load(url, name, prompts[:2], 2, 2, 0, args.seed))  # warm-up
        results, elapsed = run_async(run_load(url, name, prompts, args.output_len,
                                                args.concurrency, args.rate, args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    summary = {"workload": {k: getattr(args, k) for k in (
        "concurrency", "rate", "num_requests", "prompt_len", "output_len", "tiny")},
        "model": name, "http": summarise(results, elapsed)}
    print_table("HTTP (tokenloom serve)", summary["http"])
    if args.offline:
        settings = [s for s in args.set if not s.startswith("server.")]
        summary["offline"] = run_offline(model, prompts, args.output_len, settings,
                                         args.concurrency)
        ratio = summary["http"]["output_tokens_per_s"] / summary["offline"]["output_tokens_per_s"]
        summary["http_over_offline"] = ratio
        print(f"\noffline LLM.generate: {summary['offline']['output_tokens_per_s']:.0f} output "
              f"tok/s; HTTP/offline = {ratio:.3f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"\nwrote {out}")
    if args.transformers:
        tproc, turl = start_transformers(resolve_dir(model))
        try:
            tname = run_async(model_name(turl))
            run_async(run_load(turl, tname, prompts[:2], 2, 2, 0, args.seed, False))
            tresults, telapsed = run_async(run_load(turl, tname, prompts, args.output_len,
                                                      args.concurrency, args.rate, args.seed,
                                                      False))
        finally:
            tproc.terminate()
            tproc.wait(60)
        summary["transformers"] = summarise(tresults, telapsed)
        print_table("transformers serve --continuous-batching", summary["transformers"])
        ratio = (summary["http"]["output_tokens_per_s"]
                 / summary["transformers"]["output_tokens_per_s"])
        summary["tokenloom_over_transformers"] = ratio
        print(f"\ntokenloom / transformers output tok/s = {ratio:.2f}")
        out.write_text(json.dumps(summary, indent=2))
    if tmp is not None:
        tmp.cleanup()


def interference(args) -> None:
    from interference import interference_main

    if args.output_len == 64:   # the workload unless given
        args.output_len = 256
    if args.prompt_len == 256:
        args.prompt_len = 64
    if args.json == "benchmarks/results/serve.json":
        args.json = "benchmarks/results/interference.json"
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    model, tmp = args.model, None
    if args.tiny:
        from tokenloom.config.schema import ModelConfig, resolve_cache_dir
        from tokenloom.kernels.models.loader import resolve_model_dir

        tmp = tempfile.TemporaryDirectory()
        build_tiny_model(Path(tmp.name), resolve_model_dir(
            "default", resolve_cache_dir(ModelConfig())))
        model = tmp.name
    try:
        interference_main(args, start_server, model_name, model)
    finally:
        if tmp is not None:
            tmp.cleanup()


def shared_prefix_main(args) -> None:
    """Issue 4's workload: `groups` long shared prefixes, distinct short suffixes; the same
    requests against a server with prefix caching on, then off."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(1000, 20000) for _ in range(args.prefix_len)]
                for _ in range(args.groups)]
    prompts = [prefixes[i % args.groups] + [rng.randrange(1000, 20000)
                                           for _ in range(args.suffix_len)]
               for i in range(args.num_requests)]
    warm = [[rng.randrange(1000, 20000) for _ in range(8)] for _ in range(2)]
    summary = {"workload": {k: getattr(args, k) for k in (
        "concurrency", "num_requests", "groups", "prefix_len", "suffix_len", "output_len")}}
    base_set = list(args.set)
    for label, caching in (("caching_on", "true"), ("caching_off", "false")):
        args.set = base_set + [f"cache.enable_prefix_caching={caching}"]
        proc, url = start_server(args, args.model)
        try:
            name = run_async(model_name(url))
            run_async(run_load(url, name, warm, 2, 2, 0, args.seed))
            results, elapsed = run_async(run_load(url, name, prompts, args.output_len,
                                                    args.concurrency, 0, args.seed))
        finally:
            proc.terminate()
            proc.wait(60)
        summary[label] = summarise(results, elapsed)
        print_table(f"prefix caching {caching}", summary[label])
    on, off = summary["caching_on"], summary["caching_off"]
    hit, miss = on["ttft_hit_ms"], on["ttft_miss_ms"]
    summary["hit_over_miss_ttft_p50"] = (hit["p50"] / miss["p50"]) if hit["p50"] and miss["p50"] else None
    summary["hit_over_cache_off_ttft_p50"] = (hit["p50"] / off["ttft_ms"]["p50"]) if hit["p50"] else None
    summary["throughput_on_over_off"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    print(f"\nTTFT p50: hits {hit['p50']:.0f} ms (n={hit['n']}), misses {miss['p50']:.0f} ms "
          f"(n={miss['n']}), caching off {off['ttft_ms']['p50']:.0f} ms")
    print(f"hit/miss TTFT p50 = {summary['hit_over_miss_ttft_p50']:.3f}; hit/caching-off = "
          f"{summary['hit_over_cache_off_ttft_p50']:.3f}; throughput on/off = "
          f"{summary['throughput_on_over_off']:.2f}x")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
