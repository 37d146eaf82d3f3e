"""Planted incidents (issue 30): each test plants one cause in a replay against the tiny
model — in the capture (the traffic) or in the server's configuration — replays before and
after with the real replay client over HTTP, and checks that the diagnosis's top mechanism
is the planted one. The null case: the same capture replayed twice is "no significant
change". Plus the recording loop: `admin record start|stop` on a live server, then that
capture replayed (body, tokens and hashes-only captures).

Every replay flushes the prefix cache first, so a replay never inherits the previous one's
cached blocks. No latency is asserted: the mechanisms are named from the traces' counts.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from tokenloom.daemon.admin import cli as admin_cli
from tokenloom.daemon.admin import protocol as P
from tokenloom.daemon.debug import capture as C
from tokenloom.daemon.debug import replay as R
from tokenloom.daemon.debug import report
from tokenloom.daemon.debug.diagnose import diagnose

BLOCK = 8
STABLE = " ".join(f"w{10 + (i * 7) % 90}" for i in range(120))    # a long shared prefix


def words(n: int, seed: int) -> str:
    """n vocabulary words, distinct from the first word on for distinct seeds."""
    return " ".join(f"w{3 + (seed * 31 + i * 17) % 250}" for i in range(n))


def completion(t, prompt, max_tokens=4, tenant=None, **params):
    return {"kind": "request", "t": round(t, 4), "endpoint": "completions", "tenant": tenant,
            "body": {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                     "ignore_eos": True, **params}}


def chat(t, system, user, max_tokens=4):
    return {"kind": "request", "t": round(t, 4), "endpoint": "chat",
            "body": {"model": "m", "max_tokens": max_tokens, "ignore_eos": True,
                     "messages": [{"role": "system", "content": system},
                                  {"role": "user", "content": user}]}}


def write_capture(path, lines):
    C.write(path, {"source": "record", "content": "body", "block_size": BLOCK}, lines)
    return path


def replay(server, capture, out, errors_allowed=0, speed=1.0):
    if hasattr(server, "engine"):        # an in-process server (a process: fresh anyway)
        server.call(server.engine.flush_prefix_cache(force=True))
    asyncio.run(R.run(capture, server.url, out, speed=speed, vocab=256, sample_interval=0.1))
    cap = C.load(out)
    bad = [r for r in cap.records if r["status"] != 200 or r["error"]]
    assert len(bad) <= errors_allowed, bad[:2]
    return cap


def start(tiny_model_dir, tmp_path_factory, **overrides):
    from servers import ServerThread, tiny_config
    return ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"),
                                    **overrides))


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, tmp_path_factory):
    """The healthy server: 1,024 blocks of 8 tokens, SLO chunking up to 512 tokens."""
    tmp = tmp_path_factory.mktemp("admin")
    s = start(tiny_model_dir, tmp_path_factory, **{"admin.socket_path": str(tmp / "a.sock")})
    s.admin = str(tmp / "a.sock")
    yield s
    s.close()


@pytest.fixture(scope="module")
def small_pool(tiny_model_dir, tmp_path_factory):
    """A KV pool of 64 blocks (512 tokens)."""
    s = start(tiny_model_dir, tmp_path_factory, **{"cache.num_blocks": 64,
                                                   "model.max_model_len": 512})
    yield s
    s.close()


def explain(d) -> str:
    return report.text(d)


# -- the incidents -----------------------------------------------------------------------------
def template_captures(tmp_path):
    """The app's prompt template v2 moves the volatile request metadata (two words unique to
    each request) from after the stable system prompt to before it."""
    before, after = [], []
    for i in range(24):
        meta = f"w{130 + i} w{200 + i % 7}"
        before.append(chat(0.04 * i, STABLE, f"{meta} w33 w34"))
        after.append(chat(0.04 * i, f"{meta} {STABLE}", "w33 w34"))
    return (write_capture(tmp_path / "v1.jsonl", before),
            write_capture(tmp_path / "v2.jsonl", after))


def test_template_moves_volatile_field_before_stable_prefix(baseline, tmp_path):
    v1, v2 = template_captures(tmp_path)
    d = diagnose(replay(baseline, v1, tmp_path / "b.jsonl"),
                 replay(baseline, v2, tmp_path / "a.jsonl"))
    assert d.top is not None and d.top.name == "prefix_layout", explain(d)
    assert "diverge from each other at token 0 (was 120)" in d.sentence, d.sentence
    hit_b, hit_a = d.top.figures["hit_rate"]
    assert hit_b > 0.8 and hit_a < 0.1
    diff = d.prefix_diff
    assert diff["after"]["common"] == 0 and diff["before"]["common"] >= 120
    assert "first difference at token 0" in report.text(d)


def test_null_same_capture_twice(baseline, tmp_path):
    v1, _ = template_captures(tmp_path)
    d = diagnose(replay(baseline, v1, tmp_path / "r1.jsonl"),
                 replay(baseline, v1, tmp_path / "r2.jsonl"))
    assert d.top is None, explain(d)
    # Host noise can move latency between two replays of one capture (a full-suite run on
    # a shared 2-core machine saw p95 TPOT 1.2 -> 7.3 ms): what must hold is that no
    # engine mechanism is blamed, so the verdict is "no change" or "not the engine".
    assert (d.sentence.startswith("No significant change")
            or "no mechanism in the traces explains it" in d.sentence), d.sentence


def test_noisy_tenant_floods_long_prompts(baseline, tmp_path):
    normal = [completion(0.04 * i, words(40, i), 8, tenant="ab"[i % 2]) for i in range(24)]
    flood = [completion(0.04 * i + 0.02, words(1500, 100 + i), 8, tenant="flood")
             for i in range(24)]
    b = write_capture(tmp_path / "b.jsonl", normal)
    a = write_capture(tmp_path / "a.jsonl", sorted(normal + flood, key=lambda r: r["t"]))
    d = diagnose(replay(baseline, b, tmp_path / "rb.jsonl"),
                 replay(baseline, a, tmp_path / "ra.jsonl"))
    assert d.top is not None and d.top.name == "noisy_tenant", explain(d)
    assert "tenant 'flood'" in d.sentence


def test_kv_pool_too_small(baseline, small_pool, tmp_path):
    burst = [completion(0.005 * i, words(120, i), 24) for i in range(24)]
    cap = write_capture(tmp_path / "c.jsonl", burst)
    d = diagnose(replay(baseline, cap, tmp_path / "rb.jsonl"),
                 replay(small_pool, cap, tmp_path / "ra.jsonl"))
    assert d.top is not None and d.top.name == "kv_pressure", explain(d)
    assert d.after.summary.kv_refusals_per_request + d.after.summary.preemptions_per_request > 0


def test_prefix_evicted_then_recomputed(baseline, small_pool, tmp_path):
    """A shared 400-token prefix, each use followed by two unrelated prompts: the large pool
    keeps it cached between uses; in the 64-block pool the two others turn the pool over
    (freed blocks are reused oldest first), so the prefix is evicted before it is reused."""
    shared = words(400, 7)
    lines = []
    for r in range(8):
        t = 0.45 * r
        lines.append(completion(t, f"{shared} w{20 + r} w{40 + r}", 2))
        lines.append(completion(t + 0.15, words(260, 50 + 2 * r), 2))
        lines.append(completion(t + 0.30, words(260, 51 + 2 * r), 2))
    cap = write_capture(tmp_path / "c.jsonl", lines)
    d = diagnose(replay(baseline, cap, tmp_path / "rb.jsonl"),
                 replay(small_pool, cap, tmp_path / "ra.jsonl"))
    assert d.top is not None and d.top.name == "prefix_eviction", explain(d)
    assert d.after.summary.preemptions_per_request == 0


def test_prefill_chunk_too_large_for_the_itl_target(tmp_path_factory, tmp_path):
    """Streams decode while 1,800-token prompts arrive: SLO chunking (<= 512 tokens) keeps
    their gaps short; one static 2,048-token chunk holds their next token for a whole
    prefill. The model is wider than the other tests' (hidden 256, 4 layers), so that a
    long prefill costs far more than a decode step, as on a real model, and not only the
    per-step overhead that dominates a 64-wide model on a busy CPU."""
    from tinymodel import build_tiny_model

    model = tmp_path_factory.mktemp("wide-llama")
    build_tiny_model(model, "LlamaConfig", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=2048), seed=3)
    lines = [completion(0.01 * i, words(20, i), 150) for i in range(8)]
    lines += [completion(0.1 + 0.08 * i, words(1800, 60 + i), 2) for i in range(6)]
    cap = write_capture(tmp_path / "c.jsonl", lines)
    results = []
    for name, chunking in (("rb.jsonl", {}), ("ra.jsonl", {
            "scheduler.chunking": "static", "scheduler.max_num_batched_tokens": 2048})):
        s = start(model, tmp_path_factory, **chunking)
        try:
            results.append(replay(s, cap, tmp_path / name))
        finally:
            s.close()
    d = diagnose(*results)
    assert d.top is not None and d.top.name == "prefill_interference", explain(d)
    print(explain(d))


def test_speculation_acceptance_collapses(tiny_model_dir, tmp_path_factory, tmp_path):
    """Draft-model speculation: a draft that is a copy of the target has its drafts
    accepted; a new draft checkpoint (another random model, same vocabulary) disagrees with
    the target and its drafts are rejected."""
    from tinymodel import CHAT_TEMPLATE, build_tiny_model

    other = tmp_path_factory.mktemp("other-draft")
    build_tiny_model(other, "LlamaConfig", dict(num_hidden_layers=1, tie_word_embeddings=True,
                                                max_position_embeddings=2048), seed=99,
                     chat_template=CHAT_TEMPLATE)
    cap = write_capture(tmp_path / "c.jsonl",
                        [completion(0.05 * i, words(30, i), 16) for i in range(8)])
    spec = {"speculative.method": "draft", "speculative.mode": "on"}
    results = []
    for draft, name in ((tiny_model_dir, "rb.jsonl"), (other, "ra.jsonl")):
        s = start(tiny_model_dir, tmp_path_factory, **spec,
                  **{"speculative.draft_model": str(draft)})
        try:
            results.append(replay(s, cap, tmp_path / name))
        finally:
            s.close()
    d = diagnose(*results)
    assert d.top is not None and d.top.name == "spec_collapse", explain(d)
    acc_b, acc_a = d.top.figures["acceptance"]
    assert acc_b > 0.9 and acc_a < acc_b - 0.2


def test_router_imbalance_across_workers(tiny_model_dir, tmp_path_factory, tmp_path):
    """Two worker processes, prefix routing with no price on load (decode_weight 0): distinct
    prompts spread over both workers; prompts sharing a long prefix all follow it to one."""
    from servers import ServerProcess

    tmp = tmp_path_factory.mktemp("workers")
    spread = [completion(0.05 * i, words(80, i), 4) for i in range(16)]
    shared = words(160, 3)
    follow = [completion(0.05 * i, f"{shared} {words(8, 40 + i)}", 4) for i in range(16)]
    b = write_capture(tmp_path / "b.jsonl", spread)
    a = write_capture(tmp_path / "a.jsonl", follow)
    s = ServerProcess("--workers", "2", "--model", str(tiny_model_dir),
                      "--set", "model.device=cpu", "--set", "model.dtype=float32",
                      "--set", f"model.cache_dir={tmp / 'cache'}",
                      "--set", f"cache.block_size={BLOCK}", "--set", "cache.num_blocks=512",
                      "--set", f"admin.socket_path={tmp / 'admin.sock'}",
                      "--set", "workers.decode_weight=0.0", timeout=300)
    try:
        d = diagnose(replay(s, b, tmp_path / "rb.jsonl"), replay(s, a, tmp_path / "ra.jsonl"))
    finally:
        assert s.stop() == 0
    assert d.top is not None and d.top.name == "router_imbalance", explain(d)
    assert max(d.after.summary.workers.values(), key=lambda g: g.requests).request_share > 0.8


# -- the recording loop ------------------------------------------------------------------------
def admin(server, command):
    return admin_cli.send(server.admin, command)


def post(url, path, body, headers=None):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("content", ["body", "tokens", "hashes"])
def test_record_live_traffic_then_replay_it(baseline, model_name, tmp_path, content):
    """1. start recording over the admin socket 2. live requests (chat and completions,
    two tenants, one the engine refuses) 3. stop 4. the capture holds each request with its
    usage and trace 5. replaying it gives the same prompts (same prompt token counts;
    hashes-only: the same sharing structure, hence the same cached tokens)."""
    path = tmp_path / f"live-{content}.jsonl"
    reply = admin(baseline, P.RecordStart(path=str(path), content=content))
    assert isinstance(reply, P.RecordReply) and reply.recording, reply
    again = admin(baseline, P.RecordStart(path=str(tmp_path / "x.jsonl")))
    assert isinstance(again, P.ErrorReply) and "already recording" in again.error
    baseline.call(baseline.engine.flush_prefix_cache(force=True))
    for i in range(4):
        post(baseline.url, "/v1/chat/completions",
             {"model": model_name, "max_tokens": 3, "messages": [
                 {"role": "system", "content": STABLE},
                 {"role": "user", "content": f"w{140 + i} w33"}]}, {"X-Tenant": "t1"})
        post(baseline.url, "/v1/completions", {"model": model_name, "max_tokens": 2,
                                               "prompt": words(30, i), "user": "t2"})
    with pytest.raises(urllib.error.HTTPError):   # refused by the engine: longer than the context
        post(baseline.url, "/v1/completions", {"model": model_name, "prompt": words(2100, 1),
                                               "max_tokens": 2})
    stopped = admin(baseline, P.RecordStop())
    assert isinstance(stopped, P.RecordReply) and not stopped.recording
    assert stopped.requests == 9 and stopped.dropped == 0, stopped
    cap = C.load(path)
    assert cap.header["content"] == content and cap.header["block_size"] == BLOCK
    served = [r for r in cap.records if r["status"] == 200]
    assert len(served) == 8 and [r["status"] for r in cap.records].count(400) == 1
    assert {r["tenant"] for r in served} == {"t1", "t2"}
    for r in served:
        assert r["usage"]["prompt_tokens"] > 0 and r["metrics"]["trace"][0]["events"]
        if content == "hashes":
            assert "body" not in r and "prompt_token_ids" not in r and r["blocks"]["hashes"]
            assert "w33" not in json.dumps(r["params"])
    # The recording was serial (a blocking client, each request done before the next), and
    # so must the replay be for the same prefix hits: at 1x its open-loop arrivals may
    # overlap, since this replay's asyncio client shares the in-process server's GIL and each
    # request runs several times slower than recorded; a request admitted while the previous
    # one still prefills the shared system prompt then hits only the blocks committed so
    # far. At 1/20 speed each arrives long after the previous one ended.
    out = replay(baseline, path, tmp_path / f"replay-{content}.jsonl", errors_allowed=1,
                 speed=0.05)
    replayed = {r["index"]: r for r in out.records}
    for i, r in enumerate(cap.records):
        if r["status"] == 200:
            assert replayed[i]["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]
            cached = replayed[i]["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == r["usage"]["prompt_tokens_details"]["cached_tokens"]
    # The capture itself is a cohort too: diagnosing it against its replay finds no mechanism
    # in the traces' counts (caching, batching, preemption, KV plan, routing). Latency alone
    # is not comparable here: the capture came from a blocking client, one request at a time,
    # while the replay's asyncio client streams in this same process as the server thread and
    # competes with it for the GIL, so `compute_slowdown` (the one latency-only mechanism) may
    # fire on a loaded machine. Two replays under the same conditions are the null case
    # (test_null_same_capture_twice).
    d = diagnose(cap, out)
    assert [f.name for f in d.findings if f.significant and f.name != "compute_slowdown"] == [], \
        explain(d)


def test_plain_replay_sends_no_extensions(baseline, tmp_path):
    """`--plain` (any OpenAI-compatible server): no return_metrics, so no traces come back;
    usage and the client-side timings still do, and diagnose works on what there is."""
    cap = write_capture(tmp_path / "c.jsonl",
                        [completion(0.02 * i, words(30, i), 4, tenant="t") for i in range(6)])
    asyncio.run(R.run(cap, baseline.url, tmp_path / "plain.jsonl", plain=True))
    out = C.load(tmp_path / "plain.jsonl")
    assert out.header["plain"] is True and "prompt_token_ids" not in out.records[0]
    for r in out.records:
        assert r["status"] == 200 and r["metrics"] is None and r["usage"]["completion_tokens"] == 4
        # (gaps between streamed text deltas: a delta may carry two tokens when the
        # detokenizer held the first one back)
        assert r["ttft"] > 0 and 1 <= len(r["itl"]) <= 3
    assert diagnose(out, out).top is None
