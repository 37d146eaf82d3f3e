"""`tokenloom replay CAPTURE --url URL [--speed X]`: send a capture's requests at their
recorded offsets (open loop: a slow server does not slow the arrivals down), stream every
one, and write what came back — usage, client-side timings, and against tokenloom the
server's per-request metrics and trace — as JSONL (capture.py's `response` lines).

Against any OpenAI-compatible server (`--plain`): tokenloom's extensions (`return_metrics`,
`cache_salt`, `priority`, X-Tenant/X-Priority headers) are left out, so only usage and the
client-side timings come back.

Prompts: a capture's `body` is sent as recorded (through the server's current chat template:
a template change shows); `prompt_token_ids` go to /v1/completions as token ids; `blocks`
(hashes only, no text) become synthetic token ids, one deterministic block per hash, so
requests that shared a prefix still share one (`--vocab` bounds the ids).

The pure parts (`build_request`, `synthetic_tokens`, `parse_prometheus`, `StreamTimer`) are
tested without a server; `run` is the aiohttp client.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from tokenloom.daemon.debug import capture as C

EXTENSIONS = ("return_metrics", "cache_salt", "priority", "speculative")
FIRST_SYNTHETIC_ID = 3          # below: special tokens of most vocabularies (unk, bos, eos)


def synthetic_tokens(blocks: dict, block_size: int, vocab: int, index: int) -> list[int]:
    """Token ids for a hashes-only record: each full block's ids derive from its chain hash
    (equal hashes -> equal blocks, and the chain makes equal hashes mean equal prefixes);
    the partial tail is unique to the request."""
    out: list[int] = []
    hi = max(FIRST_SYNTHETIC_ID + 1, vocab)
    for h in blocks.get("hashes", ()):
        rng = random.Random(bytes.fromhex(h))
        out += [rng.randrange(FIRST_SYNTHETIC_ID, hi) for _ in range(block_size)]
    tail = max(0, int(blocks.get("num_tokens", len(out))) - len(out))
    rng = random.Random(f"tail-{index}")
    out += [rng.randrange(FIRST_SYNTHETIC_ID, hi) for _ in range(tail)]
    return out


def build_request(rec: dict, *, block_size: int, plain: bool = False, model: str | None = None,
                  vocab: int = 32000, index: int = 0) -> tuple[str, dict, dict]:
    """(path, body, headers) for one capture record, streamed with usage."""
    if "body" in rec:
        body = dict(rec["body"])
        path = "/v1/chat/completions" if rec.get("endpoint") == "chat" else "/v1/completions"
    else:
        body = dict(rec.get("params") or {})
        body.pop("messages", None)
        if "prompt_token_ids" in rec:
            body["prompt"] = list(rec["prompt_token_ids"])
        elif "blocks" in rec:
            body["prompt"] = synthetic_tokens(rec["blocks"], block_size, vocab, index)
        else:
            raise ValueError(f"record {index}: no body, prompt_token_ids or blocks")
        path = "/v1/completions"   # token ids: the template was applied when recorded
        for key in ("tools", "tool_choice", "response_format"):
            body.pop(key, None)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if model is not None:
        body["model"] = model
    headers = {"Content-Type": "application/json"}
    if plain:
        for key in EXTENSIONS:
            body.pop(key, None)
    else:
        body["return_metrics"] = True
        if rec.get("salt") is not None and "cache_salt" not in body:
            body["cache_salt"] = rec["salt"]
        if rec.get("tenant") is not None and "user" not in body:
            headers["X-Tenant"] = str(rec["tenant"])
        if rec.get("priority") not in (None, 0) and "priority" not in body:
            headers["X-Priority"] = str(rec["priority"])
    return path, body, headers


class StreamTimer:
    """Client-side timings of one SSE stream: feed it each `data:` payload with its arrival
    time. TTFT is the first chunk carrying text (or a tool-call fragment)."""

    def __init__(self, sent: float):
        self.sent = sent
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.usage: dict | None = None
        self.metrics: dict | None = None
        self.error: str | None = None
        self.request_id: str | None = None

    def feed(self, data: str, t: float) -> None:
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"bad SSE payload: {data[:80]!r}"
            return
        if "error" in chunk:
            self.error = (chunk["error"] or {}).get("message") or "error event"
            return
        self.request_id = self.request_id or chunk.get("id")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("metrics"):
            self.metrics = chunk["metrics"]
        if any(_has_output(c) for c in chunk.get("choices") or ()):
            if self.first is None:
                self.first = t
            elif self.last is not None:
                self.gaps.append(t - self.last)
            self.last = t

    def result(self, end: float) -> dict:
        return {"ttft": None if self.first is None else round(self.first - self.sent, 6),
                "itl": [round(g, 6) for g in self.gaps],
                "e2e": round(end - self.sent, 6), "usage": self.usage,
                "metrics": self.metrics, "error": self.error, "request_id": self.request_id}


def _has_output(choice: dict) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("tool_calls"))


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a /metrics page, keyed `name{label="v",...}` (labels sorted); histogram
    buckets are left out (their _sum and _count are kept)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def _gauge(metrics: dict[str, float], name: str) -> float | None:
    vals = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
    return sum(vals) if vals else None


# -- the client ----------------------------------------------------------------------------
async def _send(session, url: str, index: int, rec: dict, start: float, speed: float,
                opts: dict) -> dict:
    import aiohttp

    due = start + float(rec.get("t", 0.0)) / speed
    await asyncio.sleep(max(0.0, due - time.monotonic()))
    path, body, headers = build_request(rec, block_size=opts["block_size"],
                                        plain=opts["plain"], model=opts["model"],
                                        vocab=opts["vocab"], index=index)
    sent = time.monotonic()
    out = {"kind": "response", "index": index, "t": rec.get("t", 0.0),
           "sent": round(sent - start, 6), "endpoint": rec.get("endpoint", "completions"),
           "tenant": rec.get("tenant"), "status": 0, "_body": body, "_path": path}
    timer = StreamTimer(sent)
    try:
        async with session.post(url + path, json=body, headers=headers) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                text = await resp.text()
                try:
                    timer.error = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    timer.error = text[:200]
            else:
                buf = b""
                async for piece in resp.content.iter_any():
                    now = time.monotonic()
                    buf += piece
                    while b"\n\n" in buf:
                        frame, buf = buf.split(b"\n\n", 1)
                        for line in frame.split(b"\n"):
                            if line.startswith(b"data:"):
                                timer.feed(line[5:].strip().decode(), now)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        timer.error = f"{type(e).__name__}: {e}"
    out.update(timer.result(time.monotonic()))
    return out


async def _sample_gauges(session, url: str, start: float, interval: float, samples: list,
                         stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            async with session.get(url + "/metrics") as resp:
                if resp.status != 200:
                    return
                m = parse_prometheus(await resp.text())
            samples.append({"t": round(time.monotonic() - start, 3),
                            "kv_usage": _gauge(m, "vllm:kv_cache_usage_perc"),
                            "waiting": _gauge(m, "vllm:num_requests_waiting"),
                            "running": _gauge(m, "vllm:num_requests_running")})
        except Exception:   # a plain server without /metrics: no samples
            return
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


async def _scrape(session, url: str) -> dict[str, float] | None:
    try:
        async with session.get(url + "/metrics") as resp:
            return parse_prometheus(await resp.text()) if resp.status == 200 else None
    except Exception:
        return None


async def _tokenize(session, url: str, results: list[dict], limit: int = 4) -> None:
    """Prompt token ids of each replayed request, asked of tokenloom's /tokenize after the
    replay (never during it: the measurements stay clean)."""
    sem = asyncio.Semaphore(limit)

    async def one(r: dict) -> None:
        body = r["_body"]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            r["prompt_token_ids"] = prompt
            return
        req = ({"messages": body["messages"]} if "messages" in body
               else {"prompt": prompt} if isinstance(prompt, str) else None)
        if req is None:
            return
        async with sem:
            async with session.post(url + "/tokenize", json=req) as resp:
                if resp.status == 200:
                    r["prompt_token_ids"] = (await resp.json())["tokens"]
    await asyncio.gather(*(one(r) for r in results))


async def run(capture_path: str | Path, url: str, out_path: str | Path, *, speed: float = 1.0,
              plain: bool = False, model: str | None = None, vocab: int = 32000,
              sample_interval: float = 0.25, timeout: float = 600.0,
              tokenize: bool = True) -> list[dict]:
    """Replay the capture against `url`; write and return the responses."""
    import aiohttp

    if speed <= 0:
        raise ValueError(f"--speed must be > 0, got {speed}")
    cap = C.load(capture_path)
    url = url.rstrip("/")
    block_size = int(cap.header.get("block_size") or 16)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        if model is None:
            async with session.get(url + "/v1/models") as resp:
                resp.raise_for_status()
                model = (await resp.json())["data"][0]["id"]
        before = await _scrape(session, url)
        samples: list[dict] = []
        stop = asyncio.Event()
        start = time.monotonic()
        started_at = time.time()
        sampler = asyncio.create_task(_sample_gauges(session, url, start, sample_interval,
                                                     samples, stop))
        opts = {"block_size": block_size, "plain": plain, "model": model, "vocab": vocab}
        results = await asyncio.gather(*(_send(session, url, i, rec, start, speed, opts)
                                         for i, rec in enumerate(cap.records)))
        stop.set()
        await sampler
        after = await _scrape(session, url)
        if tokenize and not plain:
            await _tokenize(session, url, results)
    header = {"source": "replay", "capture": str(capture_path), "url": url, "speed": speed,
              "plain": plain, "model": model, "started_at": started_at,
              "block_size": block_size, "content": cap.header.get("content")}
    server = {"kind": "server", "before": before or {}, "after": after or {},
              "samples": samples}
    for r in results:
        r.pop("_body")
        r.pop("_path")
    C.write(out_path, header, [*results, server])
    return results
