"""The agent APIs against chat completions on the same agent conversations — TTFT p50/p99 and
the fraction of prompt tokens served from the prefix cache, through /v1/responses and
/v1/messages beside /v1/chat/completions — and /v1/embeddings throughput against
transformers' own forward on the same weights.

Agent workload: `--conversations` conversations at once (started `--stagger-ms` apart), each
with the same long system prompt (about `--system-len` tokens) and tool list, then `--turns`
turns: a new user message, the assistant's answer (`--output-len` tokens, ignore_eos,
sampled with a seed per conversation and turn), appended to the transcript the next turn
sends whole, as a coding agent's grows. (Sampled, not greedy: the random model's greedy
answer is a run of newlines, which an answer that may still become a tool call holds back
to its end, so its "first token" would be its last.) Each API has its own copy of the same
conversations, under a cache salt of its own per round (`--rounds`), so each starts from a
cold prefix cache and reuses only its own prefixes; the APIs are interleaved turn by turn
(step t's turns through one API at once, then the next, the order rotating every step), so
load from outside the server on a shared machine falls on each alike. TTFT is
from the send to the stream's first answer text (chat: a content delta; Responses:
response.output_text.delta; Messages: a text_delta): p50 over every turn; p99 each round's,
then the median over rounds, so that a stall from outside the server (the machine is shared)
landing in one API's run does not decide the comparison. The cached fraction is each API's
own usage (chat's prompt_tokens_details.cached_tokens, Responses'
input_tokens_details.cached_tokens, Messages' cache_read_input_tokens) over the prompt
tokens. The answers through each API are checked equal to chat's (same seeds, same prompts).

Embeddings: the same server (started with server.embeddings), `--embed-len`-token inputs as
token ids, one per request (batch 1) and 32 per request (batch 32), sequences/s, against
transformers' AutoModel forward in this process on the same weights (fp32, the same thread
count, last token pooled and normalized; one sequence at a time, then 32 at once),
alternating batch by batch. The vectors are checked equal (max abs difference reported).

Model: a tiny random Llama with the default model's vocabulary and chat template
(harness.build_tiny_vocab_model), so a run takes minutes on 2 cores.

    python benchmarks/agent_apis.py
    python benchmarks/agent_apis.py --quick      # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import (
    VOCAB_HI,
    VOCAB_LO,
    build_tiny_vocab_model,
    model_name,
    percentile,
    run_async,
    start_tokenloom,
)
from records import record_run, write_raw

APIS = ("chat", "responses", "messages")
WORDS = ("module", "function", "test", "failing", "import", "config", "parser", "request",
         "cache", "block", "token", "thread", "queue", "error", "value", "return", "class",
         "field", "schema", "stream", "event", "handler", "server", "client", "commit")
TOOLS = [("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
         ("run_tests", "Run the test suite, or one test file.", {"target": {"type": "string"}}),
         ("apply_patch", "Apply a unified diff to the repository.",
          {"patch": {"type": "string"}})]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def system_prompt(tokens: int) -> str:
    """A fixed system prompt of about `tokens` tokens (about one per word here)."""
    rng = random.Random(1234)
    lines = ["You are a coding agent working in a Python repository. Follow these rules."]
    while sum(len(line.split()) for line in lines) < tokens:
        lines.append(f"- Rule {len(lines)}: {_text(rng, 24)}.")
    return "\n".join(lines)


# -- one streamed turn per API ---------------------------------------------------------------
def _tool_schema(props: dict) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


def request(api: str, model: str, system: str, history: list[dict], n: int, salt: str,
            seed: int):
    """(path, body) of one turn: the conversation so far through `api`."""
    common = {"model": model, "temperature": 1.0, "seed": seed, "ignore_eos": True,
              "stream": True, "cache_salt": salt}
    if api == "chat":
        tools = [{"type": "function", "function": {"name": name, "description": doc,
                                                   "parameters": _tool_schema(props)}}
                 for name, doc, props in TOOLS]
        return "/v1/chat/completions", {
            **common, "messages": [{"role": "system", "content": system}, *history],
            "tools": tools, "max_tokens": n, "stream_options": {"include_usage": True}}
    if api == "responses":
        tools = [{"type": "function", "name": name, "description": doc,
                  "parameters": _tool_schema(props)} for name, doc, props in TOOLS]
        return "/v1/responses", {**common, "instructions": system, "input": history,
                                 "tools": tools, "max_output_tokens": n}
    tools = [{"name": name, "description": doc, "input_schema": _tool_schema(props)}
             for name, doc, props in TOOLS]
    return "/v1/messages", {**common, "system": system, "messages": history, "tools": tools,
                            "max_tokens": n}


def _answer_event(api: str, event: dict) -> str | None:
    """The answer text an SSE event carries (None: not an answer text event)."""
    if api == "chat":
        choices = event.get("choices") or []
        return (choices[0].get("delta") or {}).get("content") if choices else None
    if api == "responses":
        return event.get("delta") if event.get("type") == "response.output_text.delta" else None
    delta = event.get("delta") or {}
    return delta.get("text") if delta.get("type") == "text_delta" else None


def _usage(api: str, event: dict) -> tuple[int, int] | None:
    """(prompt tokens, cached prompt tokens) when the event carries the final usage."""
    if api == "chat" and event.get("usage"):
        u = event["usage"]
        return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    if api == "responses" and event.get("type") in ("response.completed",
                                                    "response.incomplete"):
        u = event["response"]["usage"]
        return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
    if api == "messages" and event.get("type") == "message_delta":
        u = event["usage"]
        read = u["cache_read_input_tokens"]
        return u["input_tokens"] + read + u["cache_creation_input_tokens"], read
    return None


async def turn(session, url: str, api: str, body: dict, path: str) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with session.post(url + path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{api}: {r.status} {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            piece = _answer_event(api, event)
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(piece)
            usage = _usage(api, event) or usage
    return {"ttft": ttft, "text": "".join(text), "prompt": usage[0], "cached": usage[1]}


async def agent_round(url: str, model: str, system: str, args, round_index: int,
                      apis=APIS) -> dict[str, list[list[dict]]]:
    """One round: every API's own copy of the conversations, interleaved turn by turn (the
    `--conversations` turns of step t through one API at once, then through the next, in an
    order that rotates every step), so load from outside the server (the machine is shared)
    falls on every API alike. Returns {api: [conversation][turn] -> result}."""
    import aiohttp

    histories = {api: [[] for _ in range(args.conversations)] for api in apis}
    out = {api: [[] for _ in range(args.conversations)] for api in apis}
    rngs = {api: [random.Random(c) for c in range(args.conversations)] for api in apis}

    async def one(session, api: str, c: int, t: int) -> None:
        if t == 0:
            # Agents start one after another, not in the same millisecond: whether a first
            # turn finds the system prompt cached does not hang on which request's prefill
            # the scheduler happened to take first.
            await asyncio.sleep(c * args.stagger_ms / 1e3)
        history = histories[api][c]
        history.append({"role": "user",
                        "content": f"Step {t}: {_text(rngs[api][c], args.user_len)}"})
        path, body = request(api, model, system, history, args.output_len,
                             f"{api}-{round_index}", seed=1000 * c + t)
        result = await turn(session, url, api, body, path)
        history.append({"role": "assistant", "content": result["text"]})
        out[api][c].append(result)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for t in range(args.turns):
            k = (t + round_index) % len(apis)
            for api in apis[k:] + apis[:k]:
                await asyncio.gather(*(one(session, api, c, t)
                                       for c in range(args.conversations)))
    return out


# -- embeddings --------------------------------------------------------------------------------
async def embed_batch(session, url: str, batch: list[list[int]]) -> tuple[float, list]:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/embeddings", json={"input": batch}) as r:
        data = (await r.json())["data"]
    return time.perf_counter() - t0, [d["embedding"] for d in data]


def transformers_batch(model, batch: list[list[int]]) -> tuple[float, list]:
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        h = model(input_ids=torch.tensor(batch)).last_hidden_state[:, -1]   # [B, hidden]
        vectors = torch.nn.functional.normalize(h, dim=-1).tolist()
    return time.perf_counter() - t0, vectors


async def embed_compare(url: str, model, batches: list[list[list[int]]]):
    """Each batch through the server, then through transformers, alternating: (server
    seconds, transformers seconds, max |difference| of the vectors)."""
    import aiohttp

    ours = theirs = diff = 0.0
    async with aiohttp.ClientSession() as session:
        for batch in batches:
            dt, a = await embed_batch(session, url, batch)
            ours += dt
            dt, b = transformers_batch(model, batch)
            theirs += dt
            diff = max(diff, float(np.abs(np.asarray(a) - np.asarray(b)).max()))
    return ours, theirs, diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system-len", type=int, default=1500)
    p.add_argument("--user-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--stagger-ms", type=float, default=100.0,
                   help="between the starts of successive conversations")
    p.add_argument("--embed-len", type=int, default=128)
    p.add_argument("--embed-sequences", type=int, default=128,
                   help="sequences per embeddings measurement (a multiple of 32)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny settings")
    args = p.parse_args()
    if args.quick:
        args.conversations, args.turns, args.rounds = 2, 2, 1
        args.system_len, args.embed_sequences = 200, 32
    import torch
    import transformers

    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    from tokenloom.kernels.models.loader import resolve_model_dir

    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    model_dir = Path(tmp.name)
    default_dir = Path(resolve_model_dir("default", resolve_cache_dir(ModelConfig())))
    build_tiny_vocab_model(model_dir, default_dir)
    if (default_dir / "chat_template.jinja").is_file():   # (the template, beside the tokenizer)
        shutil.copy(default_dir / "chat_template.jinja", model_dir)
    server = start_tokenloom(str(model_dir), ["server.embeddings=true",
                                              f"model.num_threads={args.threads}",
                                              "scheduler.max_num_batched_tokens=4096"])
    system = system_prompt(args.system_len)
    agent: dict[str, list] = {api: [] for api in APIS}
    transcripts: dict[str, list] = {}
    rates: dict[str, list[float]] = {k: [] for k in ("t1", "h1", "t32", "h32")}
    diff = 0.0
    try:
        name = run_async(model_name(server.url))
        # Warm-up: the whole workload once, untimed (the CPU kernels are planned per batch
        # size the first time one runs: a second's stall that would land in one API's turns).
        run_async(agent_round(server.url, name, system, args, -1, ("chat",)))
        for r in range(args.rounds):
            for api, convs in run_async(agent_round(server.url, name, system, args, r)).items():
                agent[api] += [dict(t, round=r) for conv in convs for t in conv]
                transcripts.setdefault(api, [[t["text"] for t in conv] for conv in convs])
        hf = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
        rng = random.Random(7)
        seqs = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(args.embed_len)]
                for _ in range(args.embed_sequences)]
        ones, thirty_twos = [[s] for s in seqs], [seqs[i:i + 32] for i in range(0, len(seqs), 32)]
        run_async(embed_compare(server.url, hf, ones[:2]))       # warm-up
        for _ in range(args.rounds):
            for key, batches in (("1", ones), ("32", thirty_twos)):
                ours, theirs, d = run_async(embed_compare(server.url, hf, batches))
                rates["t" + key].append(len(seqs) / ours)
                rates["h" + key].append(len(seqs) / theirs)
                diff = max(diff, d)
    finally:
        server.stop()
        tmp.cleanup()

    def ms(xs, q):
        """p50: over every turn; p99: each round's, then the median over the rounds (a
        stall from outside the server, on a shared machine, lands in one round)."""
        if q == 50:
            return percentile([x["ttft"] for x in xs], q, 1e3)
        rounds = sorted({x["round"] for x in xs})
        return float(np.median([percentile([x["ttft"] for x in xs if x["round"] == r], q,
                                           1e3) for r in rounds]))

    def cached(xs):
        return sum(x["cached"] for x in xs) / sum(x["prompt"] for x in xs)

    chat50, chat99 = ms(agent["chat"], 50), ms(agent["chat"], 99)
    summary = {"ttft_p50_ms": {a: ms(agent[a], 50) for a in APIS},
               "ttft_p99_ms": {a: ms(agent[a], 99) for a in APIS},
               "p50_over_chat": {a: ms(agent[a], 50) / chat50 for a in APIS[1:]},
               "p99_over_chat": {a: ms(agent[a], 99) / chat99 for a in APIS[1:]},
               "cached_fraction": {a: cached(agent[a]) for a in APIS},
               "answers_equal_chat": {a: transcripts[a] == transcripts["chat"]
                                      for a in APIS[1:]},
               "embeddings_seq_s": {k: float(np.median(v)) for k, v in rates.items()},
               "embeddings_max_abs_diff": diff}
    e = summary["embeddings_seq_s"]
    summary["embeddings_over_transformers"] = {"batch_1": e["t1"] / e["h1"],
                                               "batch_32": e["t32"] / e["h32"]}
    columns = ["measure", "tokenloom", "baseline", "ratio", "cached fraction"]
    rows = []
    for a in APIS:
        rows.append([f"{a} TTFT p50 (ms)", ms(agent[a], 50), chat50, ms(agent[a], 50) / chat50,
                     cached(agent[a])])
    for a in APIS:
        rows.append([f"{a} TTFT p99 (ms)", ms(agent[a], 99), chat99, ms(agent[a], 99) / chat99,
                     None])
    rows.append(["embeddings batch 1 (seq/s; baseline transformers)", e["t1"], e["h1"],
                 e["t1"] / e["h1"], None])
    rows.append(["embeddings batch 32 (seq/s; baseline transformers)", e["t32"], e["h32"],
                 e["t32"] / e["h32"], None])
    print(f"{columns[0]:<52} {columns[1]:>10} {columns[2]:>10} {columns[3]:>7} "
          f"{columns[4]:>8}")
    for row in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else ("" if v is None else str(v))
                 for v in row[1:]]
        print(f"{row[0]:<52} {cells[0]:>10} {cells[1]:>10} {cells[2]:>7} {cells[3]:>8}")
    print(f"answers equal chat's: {summary['answers_equal_chat']}; embeddings max |diff| "
          f"{diff:.2e}")
    write_raw("agent_apis", {"summary": summary, "turns": agent})
    headline = {"p50_over_chat": summary["p50_over_chat"],
                "cached_fraction": summary["cached_fraction"],
                "answers_equal_chat": summary["answers_equal_chat"],
                "embeddings_over_transformers": summary["embeddings_over_transformers"],
                "embeddings_max_abs_diff": diff}
    record_run("agent_apis", headline, {"columns": columns, "rows": rows}, args,
               smoke=args.quick)


if __name__ == "__main__":
    main()
