"""Soak test: mixed traffic against a live `tokenloom serve` for a while, then leak checks.

    python benchmarks/soak.py --duration 600            # a tiny random Llama, 10 minutes
    python benchmarks/soak.py --duration 3600

Starts `tokenloom serve` (a tiny random Llama built in a temporary directory, or --model)
with its admin socket in a temporary directory, then runs `--concurrency` clients, each
looping over a random mix of:
  stream / non-stream completions and chat, n > 1, prompts sharing long prefixes, client
  disconnects mid-stream, non-streamed requests given up on, slow readers (a raw socket
  with a tiny receive buffer reading one byte a second: the server must cut it off after
  server.write_timeout_seconds), bad requests (bad JSON, out-of-range values, unknown model,
  a prompt over the context window), and admin `stats` / `flush-cache` calls.
After a warm-up phase the server is left to go idle and measured through the admin socket
(RSS, open fds, asyncio tasks, KV blocks); after the main phase, again. Then it checks:
- every request was answered as expected or cancelled by its own client (no 5xx, every
  stream ends with `[DONE]`, full streams carry every token asked for);
- zero KV blocks in use and no open streams once idle (no leaked blocks);
- RSS growth under --rss-bound-mib (64 MiB; the per-minute figures show that it levels
  off: bounded structures fill up (the prefix cache's metadata up to the pool size and its
  memory of evicted hashes up to 4x the pool, the trace history) and oneDNN builds a
  primitive per row-count bucket it meets, kernels/cpu/onednn.py); no growth in asyncio
  tasks, and open fds within --fd-slack of the baseline;
- the p99 latency of fixed-size non-streamed requests in the last window (a minute, or a
  fifth of a shorter run) within --p99-ratio (1.5) of the first window's (skipped with
  --no-latency-check: the test suite's short run makes no timing assertion).
Prints a table and exits 1 when a check fails; the table is the run's record
(benchmarks/records.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from harness import percentile, start_tokenloom, tests_module
from records import record_run

PREFIXES = [" ".join(f"w{(i * 7 + j) % 97}" for j in range(120)) for i in range(3)]
KINDS = {  # kind -> weight
    "stream": 20, "nonstream": 15, "fixed": 10, "chat_stream": 10, "n_many": 8,
    "shared_prefix": 12, "disconnect": 8, "give_up": 5, "bad": 10, "slow_reader": 1,
}
FIXED = dict(prompt="w1 w2 w3 w4", max_tokens=16, ignore_eos=True, temperature=0)


@dataclasses.dataclass
class Record:
    kind: str
    start: float
    end: float
    outcome: str            # ok | cancelled | rejected | FAILED: ...


@dataclasses.dataclass
class Soak:
    url: str
    model: str
    admin: str
    rng: random.Random
    records: list[Record] = dataclasses.field(default_factory=list)
    slow_readers: int = 0
    admin_calls: int = 0
    rss: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (t, bytes)
    started: float = 0.0          # the last phase's start and end (monotonic)
    deadline: float = 0.0

    # -- one request of each kind ----------------------------------------------------------
    async def one(self, session: aiohttp.ClientSession, kind: str) -> str:
        r = self.rng
        base = dict(model=self.model, temperature=r.choice([0, 0.8]), seed=r.randrange(1000))
        if kind == "stream":
            n_tok = r.randint(4, 48)
            return await self.stream(session, "/v1/completions", dict(
                base, prompt=f"w{r.randrange(90)} w5 w6", max_tokens=n_tok, ignore_eos=True),
                n_tok)
        if kind == "chat_stream":
            n_tok = r.randint(4, 32)
            return await self.stream(session, "/v1/chat/completions", dict(
                base, messages=[{"role": "user", "content": f"w{r.randrange(90)} w3"}],
                max_tokens=n_tok, ignore_eos=True), n_tok)
        if kind == "n_many":
            n = r.randint(2, 4)
            n_tok = r.randint(4, 24)
            return await self.stream(session, "/v1/completions", dict(
                base, prompt="w7 w8 w9", n=n, max_tokens=n_tok, ignore_eos=True,
                temperature=0.9), n_tok * n)
        if kind == "shared_prefix":
            prompt = r.choice(PREFIXES) + f" w{r.randrange(90)}"
            return await self.complete(session, dict(base, prompt=prompt, max_tokens=8,
                                                     ignore_eos=True), 8)
        if kind in ("nonstream", "fixed"):
            body = dict(base, **FIXED) if kind == "fixed" else dict(
                base, prompt=f"w{r.randrange(90)}", max_tokens=r.randint(1, 32),
                ignore_eos=True)
            return await self.complete(session, body, body["max_tokens"])
        if kind == "disconnect":
            async with session.post(self.url + "/v1/completions", json=dict(
                    base, prompt="w1 w2", max_tokens=400, ignore_eos=True,
                    stream=True)) as resp:
                if resp.status != 200:
                    return f"FAILED: disconnect got {resp.status}"
                got = 0
                async for _ in resp.content.iter_any():
                    got += 1
                    if got >= r.randint(1, 5):
                        break
            return "cancelled"
        if kind == "give_up":
            try:
                await asyncio.wait_for(self.complete(session, dict(
                    base, prompt="w3", max_tokens=400, ignore_eos=True), 400),
                    timeout=r.uniform(0.01, 0.2))
                return "ok"
            except TimeoutError:
                return "cancelled"
        if kind == "bad":
            return await self.bad(session)
        if kind == "slow_reader":
            if self.slow_readers >= 1:          # one at a time is enough
                return await self.one(session, "stream")
            self.slow_readers += 1
            try:
                return await asyncio.to_thread(self.slow_read)
            finally:
                self.slow_readers -= 1
        raise ValueError(kind)

    async def stream(self, session, path: str, body: dict, expect_tokens: int) -> str:
        body = dict(body, stream=True, stream_options={"include_usage": True})
        async with session.post(self.url + path, json=body) as resp:
            if resp.status != 200:
                return f"FAILED: stream got {resp.status}: {(await resp.text())[:200]}"
            raw = await resp.read()
        frames = raw.decode().split("\n\n")
        if frames[-1] != "" or frames[-2] != "data: [DONE]":
            return f"FAILED: stream did not end with [DONE]: {raw[-200:]!r}"
        usage = json.loads(frames[-3][len("data: "):]).get("usage") or {}
        if usage.get("completion_tokens") != expect_tokens:
            return f"FAILED: {usage.get('completion_tokens')} tokens, wanted {expect_tokens}"
        return "ok"

    async def complete(self, session, body: dict, expect_tokens: int) -> str:
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                return f"FAILED: got {resp.status}: {data}"
        got = data["usage"]["completion_tokens"]
        return "ok" if got == expect_tokens else f"FAILED: {got} tokens, wanted {expect_tokens}"

    async def bad(self, session) -> str:
        r = self.rng
        case = r.randrange(5)
        if case == 0:
            kw = dict(data=b'{"model": ', headers={"Content-Type": "application/json"})
        elif case == 1:
            kw = dict(json=dict(model=self.model, prompt="w1", n=0))
        elif case == 2:
            kw = dict(json=dict(model="nope", prompt="w1"))
        elif case == 3:
            kw = dict(json=dict(model=self.model, prompt=[5] * 5000))
        else:
            kw = dict(json=dict(model=self.model, prompt="w1", temperature=-1))
        async with session.post(self.url + "/v1/completions", **kw) as resp:
            await resp.read()
            return "rejected" if 400 <= resp.status < 500 else f"FAILED: bad got {resp.status}"

    def slow_read(self) -> str:
        """A big stream read one byte a second by a socket with a tiny receive buffer: the
        server must cut it off (server.write_timeout_seconds) rather than hold the engine
        slot or buffer the stream."""
        port = int(self.url.rsplit(":", 1)[1])
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        body = json.dumps(dict(model=self.model, prompt="w5 w6", n=4, logprobs=20,
                               max_tokens=1500, stream=True, ignore_eos=True,
                               temperature=1.0)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        deadline = min(time.monotonic() + 30, self.deadline + 3)   # at most 3 s past the phase
        try:
            while time.monotonic() < deadline:
                try:
                    if not s.recv(1):
                        return "cancelled"       # cut off by the server
                except (ConnectionResetError, socket.timeout):
                    return "cancelled"
                time.sleep(1.0)
            # Still open: the whole stream fitted in the socket buffers (the kernel's send
            # buffer is the bound then, and the request has finished). Hang up.
            return "cancelled"
        finally:
            s.close()

    # -- the load ----------------------------------------------------------------------------
    async def client(self, deadline: float) -> None:
        kinds, weights = zip(*KINDS.items())
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < deadline:
                kind = self.rng.choices(kinds, weights)[0]
                t0 = time.monotonic()
                try:
                    outcome = await self.one(session, kind)
                except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                    outcome = f"FAILED: {e!r}"
                self.records.append(Record(kind, t0, time.monotonic(), outcome))

    async def admin_calls_loop(self, deadline: float) -> None:
        from tokenloom.daemon.admin import cli as admin_cli
        from tokenloom.daemon.admin import protocol as P

        while time.monotonic() < deadline:
            cmd = P.Stats() if self.rng.random() < 0.7 else P.FlushCache(force=True)
            reply = await asyncio.to_thread(admin_cli.send, self.admin, cmd, 30)
            if not reply.ok:
                self.records.append(Record("admin", 0, 0, f"FAILED: {reply}"))
            elif isinstance(reply, P.StatsReply) and reply.process is not None:
                self.rss.append((time.monotonic(), reply.process.rss_bytes))
            self.admin_calls += 1
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))

    async def phase(self, seconds: float, concurrency: int) -> None:
        self.started = time.monotonic()
        deadline = self.deadline = self.started + seconds
        await asyncio.gather(self.admin_calls_loop(deadline),
                             *(self.client(deadline) for _ in range(concurrency)))

    def idle_stats(self, timeout: float = 120.0):
        """Admin stats once nothing runs, nothing waits and no HTTP request is in flight."""
        from tokenloom.daemon.admin import cli as admin_cli
        from tokenloom.daemon.admin import protocol as P

        deadline = time.monotonic() + timeout
        while True:
            s = admin_cli.send(self.admin, P.Stats(), 30)
            e = s.engine
            idle = e.scheduler.running == 0 and e.scheduler.waiting == 0 and s.in_flight == 0 \
                and e.kv.used == 0 and s.process.streams_open == 0
            if idle or time.monotonic() > deadline:
                return s
            time.sleep(0.2)


def p99(values: list[float]) -> float | None:
    return percentile(values, 99)


def run(duration: float, concurrency: int = 8, seed: int = 0, model: str | None = None,
        rss_bound_mib: float = 64.0, fd_slack: int = 4, p99_ratio: float = 1.5,
        latency_check: bool = True, log=print, num_blocks: int = 4096) -> dict:
    """Start a server, soak it, check; returns the figures and `failures` (empty: passed)."""
    with tempfile.TemporaryDirectory(prefix="tokenloom-soak-") as tmp:
        tmp = Path(tmp)
        if model is None:
            tinymodel = tests_module("tinymodel")
            model = str(tmp / "tiny")
            tinymodel.build_tiny_model(Path(model), "LlamaConfig", dict(
                num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=2048),
                seed=7, chat_template=tinymodel.CHAT_TEMPLATE)
        admin = str(tmp / "admin.sock")
        server = start_tokenloom(model, [
            f'admin.socket_path="{admin}"', f'model.cache_dir="{tmp / "cache"}"',
            'model.device="cpu"', 'model.dtype="float32"', "cache.block_size=8",
            # A pool of a real deployment's order (the tiny model's 1 GiB default would be
            # 262,144 blocks, whose prefix-cache metadata alone takes hours to fill).
            f"cache.num_blocks={num_blocks}",
            "server.write_timeout_seconds=2.0", "server.max_n=4", "scheduler.max_num_seqs=32"],
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            name = Path(model).name
            soak = Soak(server.url, name, admin, random.Random(seed))
            warm = min(30.0, max(5.0, duration / 10))
            log(f"warm-up {warm:.0f} s ...")
            asyncio.run(soak.phase(warm, concurrency))
            base = soak.idle_stats()
            soak.records.clear()
            soak.rss.clear()
            log(f"soak {duration:.0f} s at concurrency {concurrency} ...")
            t0 = time.monotonic()
            asyncio.run(soak.phase(duration, concurrency))
            elapsed = time.monotonic() - t0
            end = soak.idle_stats()
        finally:
            code = server.stop()
    return check(soak, base, end, elapsed, code, rss_bound_mib, fd_slack, p99_ratio,
                 latency_check)


def check(soak: Soak, base, end, elapsed: float, exit_code: int, rss_bound_mib: float,
          fd_slack: int, p99_ratio: float, latency_check: bool) -> dict:
    recs = soak.records
    outcomes: dict[str, int] = {}
    for r in recs:
        key = r.outcome if not r.outcome.startswith("FAILED") else "failed"
        outcomes[key] = outcomes.get(key, 0) + 1
    failed = [r for r in recs if r.outcome.startswith("FAILED")]
    window = min(60.0, (soak.deadline - soak.started) / 5)
    t_first, t_last = soak.started, soak.deadline
    fixed = [r for r in recs if r.kind == "fixed" and r.outcome == "ok"]
    first = p99([r.end - r.start for r in fixed if r.start < t_first + window])
    last = p99([r.end - r.start for r in fixed if t_last - window < r.end <= t_last])
    bp, ep = base.process, end.process
    # RSS while the load ran, per minute (or fifth of a shorter run): the shape of the
    # growth tells a leak (linear) from allocator and cache warm-up (levelling off).
    trajectory = []
    for i in range(1, 6 if elapsed < 300 else int(elapsed // 60) + 1):
        t = soak.started + i * ((soak.deadline - soak.started) / 5 if elapsed < 300 else 60)
        upto = [b for ts, b in soak.rss if ts <= t]
        if upto:
            trajectory.append(round((upto[-1] - bp.rss_bytes) / 2**20, 1))
    figures = {
        "duration_s": round(elapsed, 1), "requests": len(recs), "outcomes": outcomes,
        "by_kind": {k: sum(1 for r in recs if r.kind == k) for k in KINDS},
        "admin_calls": soak.admin_calls,
        "kv_blocks_used_idle": end.engine.kv.used, "streams_open_idle": ep.streams_open,
        "rss_mib": [round(bp.rss_bytes / 2**20, 1), round(ep.rss_bytes / 2**20, 1)],
        "rss_growth_mib": round((ep.rss_bytes - bp.rss_bytes) / 2**20, 1),
        "rss_growth_by_window_mib": trajectory,
        "open_fds": [bp.open_fds, ep.open_fds], "asyncio_tasks": [bp.asyncio_tasks,
                                                                 ep.asyncio_tasks],
        "threads": [bp.threads, ep.threads], "slow_readers_cut": ep.slow_readers_cut,
        "latency_window_s": round(window, 1),
        "fixed_p99_first_s": first and round(first, 4), "fixed_p99_last_s": last and round(last, 4),
        "fixed_p99_ratio": round(last / first, 3) if first and last else None,
        "server_exit_code": exit_code,
    }
    failures = [f"{r.kind}: {r.outcome}" for r in failed[:20]]
    if end.engine.kv.used or ep.streams_open:
        failures.append(f"leak: {end.engine.kv.used} KV blocks, {ep.streams_open} streams "
                        f"still held when idle")
    if figures["rss_growth_mib"] > rss_bound_mib:
        failures.append(f"RSS grew {figures['rss_growth_mib']} MiB (bound {rss_bound_mib})")
    if ep.asyncio_tasks > bp.asyncio_tasks:
        failures.append(f"asyncio tasks grew {bp.asyncio_tasks} -> {ep.asyncio_tasks}")
    if ep.open_fds > bp.open_fds + fd_slack:
        failures.append(f"open fds grew {bp.open_fds} -> {ep.open_fds}")
    if exit_code != 0:
        failures.append(f"the server exited {exit_code} on SIGTERM")
    if latency_check and figures["fixed_p99_ratio"] is not None \
            and figures["fixed_p99_ratio"] > p99_ratio:
        failures.append(f"p99 of the last window {last:.3f} s > {p99_ratio} x the first "
                        f"{first:.3f} s")
    figures["failures"] = failures
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak (after warm-up)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a model directory (default: a tiny random Llama)")
    p.add_argument("--rss-bound-mib", type=float, default=64.0,
                   help="most RSS growth from the idle baseline after warm-up to the end")
    p.add_argument("--fd-slack", type=int, default=4)
    p.add_argument("--p99-ratio", type=float, default=1.5)
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks of 8 tokens")
    p.add_argument("--no-latency-check", action="store_true")
    args = p.parse_args()
    fig = run(args.duration, args.concurrency, args.seed, args.model, args.rss_bound_mib,
              args.fd_slack, args.p99_ratio, not args.no_latency_check,
              num_blocks=args.num_blocks)
    for k, v in fig.items():
        print(f"{k:<22} {v}")
    summary = {k: fig[k] for k in ("duration_s", "requests", "rss_growth_mib",
                                   "fixed_p99_ratio")}
    summary["failures"] = len(fig["failures"])
    record_run("soak", summary, {"columns": ["figure", "value"],
                                 "rows": [[k, v] for k, v in fig.items()]}, args)
    return 1 if fig["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
