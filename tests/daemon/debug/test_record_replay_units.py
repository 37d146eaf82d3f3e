"""The pure parts of record and replay (no server): record lines in each content mode,
the hashes mode's sharing structure and privacy, the bounded recorder, request building
for tokenloom and plain servers, synthetic prompts from hashes, SSE timing, /metrics
parsing, and the capture reader."""

from __future__ import annotations

import json

import pytest

from tokenloom.daemon.debug import capture as C
from tokenloom.daemon.debug.record import Recorder, make_record
from tokenloom.daemon.debug.replay import (
    StreamTimer,
    build_request,
    parse_prometheus,
    synthetic_tokens,
)

from tinymodel import CHAT_TEMPLATE, save_tiny_tokenizer

STABLE = " ".join(f"w{10 + i}" for i in range(40))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path, CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(path)


def chat(user: str, salt: str | None = None) -> dict:
    body = {"model": "m", "max_tokens": 4, "user": "alice",
            "messages": [{"role": "system", "content": STABLE},
                         {"role": "user", "content": user}]}
    if salt is not None:
        body["cache_salt"] = salt
    return body


def record(body, content, tokenizer, secret=b"k" * 16, endpoint="chat"):
    return make_record(t=1.5, endpoint=endpoint, body=json.dumps(body).encode(),
                       content=content, status=200, error=None, usage={"prompt_tokens": 1},
                       metrics={"trace": []}, tenant="alice", priority=0,
                       tokenizer=tokenizer, block_size=8, secret=secret)


def test_record_modes(tokenizer):
    b = record(chat("w200 w201"), "body", tokenizer)
    assert b["body"]["messages"][1]["content"] == "w200 w201" and b["tenant"] == "alice"
    t = record(chat("w200 w201"), "tokens", tokenizer)
    assert t["prompt_token_ids"][:3] == [10, 11, 12] and t["prompt_token_ids"][-1] == 3
    assert "messages" not in t["params"] and t["params"]["max_tokens"] == 4
    h = record(chat("w200 w201"), "hashes", tokenizer)
    assert h["blocks"]["num_tokens"] == len(t["prompt_token_ids"]) == 43
    assert len(h["blocks"]["hashes"]) == 43 // 8
    assert "w200" not in json.dumps(h) and "alice" not in json.dumps(h["params"])


def test_hashes_share_where_prefixes_share_and_salt_and_secret_split(tokenizer):
    one = record(chat("w200"), "hashes", tokenizer)["blocks"]["hashes"]
    two = record(chat("w201 w202 w203"), "hashes", tokenizer)["blocks"]["hashes"]
    assert one[:5] == two[:5]                       # 40 shared tokens = 5 full blocks
    moved = record({"messages": [{"role": "user", "content": "w201"},
                                 {"role": "system", "content": STABLE}]}, "hashes", tokenizer)
    assert moved["blocks"]["hashes"][0] != one[0]
    salted = record(chat("w200", salt="s1"), "hashes", tokenizer)["blocks"]["hashes"]
    assert salted[0] != one[0]
    other_capture = record(chat("w200"), "hashes", tokenizer, secret=b"x" * 16)
    assert other_capture["blocks"]["hashes"][0] != one[0]


def test_recorder_is_bounded_and_readable(tmp_path, tokenizer):
    path = tmp_path / "cap.jsonl"
    rec = Recorder(path, content="tokens", max_bytes=2000, tokenizer=tokenizer, block_size=8,
                   model="tiny")
    for i in range(20):
        rec.note(rec.start_mono + i * 0.1, "chat", json.dumps(chat(f"w{100 + i}")).encode(),
                 200, None, {"prompt_tokens": 42}, None, "alice", 0)
    rec.note(rec.start_mono, "completions", b"not json", 400, "bad body", None, None, None, 0)
    stats = rec.stop()
    assert stats["bytes"] <= 2000 and stats["dropped"] > 0
    assert stats["requests"] + stats["dropped"] == 21
    cap = C.load(path)
    assert cap.header["content"] == "tokens" and cap.header["block_size"] == 8
    assert len(cap.records) == stats["requests"]
    assert cap.records[1]["t"] == pytest.approx(0.1)


def test_a_half_written_last_line_is_skipped(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(C.dumps({"kind": "header", "source": "record"})
                    + C.dumps({"kind": "request", "t": 0}) + '{"kind": "requ')
    assert len(C.load(path).records) == 1
    (tmp_path / "bad.jsonl").write_text('{"kind": "request"}\n')
    with pytest.raises(ValueError, match="no header"):
        C.load(tmp_path / "bad.jsonl")


def test_build_request_for_tokenloom_and_plain_servers():
    rec = {"endpoint": "chat", "body": {"model": "old", "messages": [], "cache_salt": "s",
                                        "return_metrics": False}, "tenant": "t1", "priority": 5}
    path, body, headers = build_request(rec, block_size=16, model="new")
    assert path == "/v1/chat/completions" and body["model"] == "new"
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["return_metrics"] is True
    assert headers["X-Tenant"] == "t1" and headers["X-Priority"] == "5"
    _, plain, plain_headers = build_request(rec, block_size=16, plain=True)
    assert "return_metrics" not in plain and "cache_salt" not in plain
    assert "X-Tenant" not in plain_headers
    path, body, _ = build_request({"endpoint": "chat", "prompt_token_ids": [5, 6],
                                   "params": {"max_tokens": 3, "tools": []}}, block_size=16)
    assert path == "/v1/completions" and body["prompt"] == [5, 6] and "tools" not in body


def test_synthetic_tokens_keep_the_sharing_structure():
    a = {"hashes": ["aa" * 32, "bb" * 32], "num_tokens": 20}
    b = {"hashes": ["aa" * 32, "cc" * 32], "num_tokens": 16}
    ta, tb = synthetic_tokens(a, 8, 256, 0), synthetic_tokens(b, 8, 256, 1)
    assert len(ta) == 20 and len(tb) == 16
    assert ta[:8] == tb[:8] and ta[8:16] != tb[8:16]
    assert all(3 <= t < 256 for t in ta + tb)
    assert synthetic_tokens(a, 8, 256, 0) == ta               # deterministic


def test_stream_timer():
    timer = StreamTimer(sent=10.0)
    timer.feed(json.dumps({"id": "x", "choices": [{"delta": {"role": "assistant",
                                                             "content": ""}}]}), 10.1)
    timer.feed(json.dumps({"choices": [{"delta": {"content": "a"}}]}), 10.2)
    timer.feed(json.dumps({"choices": [{"delta": {"content": "b"}}]}), 10.25)
    timer.feed(json.dumps({"choices": [], "usage": {"prompt_tokens": 3},
                           "metrics": {"trace": []}}), 10.3)
    timer.feed("[DONE]", 10.3)
    r = timer.result(10.3)
    assert r["ttft"] == pytest.approx(0.2) and r["itl"] == [pytest.approx(0.05)]
    assert r["usage"] == {"prompt_tokens": 3} and r["metrics"] == {"trace": []}
    assert r["request_id"] == "x" and r["error"] is None
    bad = StreamTimer(0.0)
    bad.feed(json.dumps({"error": {"message": "boom"}}), 1.0)
    assert bad.result(1.0)["error"] == "boom"


def test_parse_prometheus():
    text = ('# TYPE vllm:num_preemptions counter\n'
            'vllm:num_preemptions_total{model_name="m"} 3.0\n'
            '# TYPE tokenloom:decode_batch_size counter\n'
            'tokenloom:decode_batch_size_total{model_name="m",size="4"} 7.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
    m = parse_prometheus(text)
    assert m["vllm:num_preemptions_total"] == 3.0
    assert m['tokenloom:decode_batch_size_total{size="4"}'] == 7.0
    assert m["vllm:kv_cache_usage_perc"] == 0.5


def test_admin_record_commands_from_the_cli(tmp_path, monkeypatch):
    from tokenloom.daemon.__main__ import build_parser
    from tokenloom.daemon.admin import cli as admin_cli
    from tokenloom.daemon.admin import protocol as P

    monkeypatch.chdir(tmp_path)
    parser = build_parser()
    args = parser.parse_args(["admin", "record", "start", "--out", "cap.jsonl", "--content",
                              "hashes"])
    assert admin_cli.build_command(args) == P.RecordStart(path=str(tmp_path / "cap.jsonl"),
                                                          content="hashes")
    assert admin_cli.build_command(parser.parse_args(["admin", "record", "stop"])) \
        == P.RecordStop()
    line = P.encode(P.RecordStart(path="/x", max_bytes=8192))
    assert P.decode_command(line) == P.RecordStart(path="/x", max_bytes=8192)
    with pytest.raises(P.ProtocolError, match="max_bytes"):
        P.decode_command(b'{"cmd": "record-start", "path": "/x", "max_bytes": 10}')
    reply = P.RecordReply(recording=False, path="/x", content="body", requests=3, bytes=10)
    assert P.decode_reply(P.encode(reply)) == reply
    assert admin_cli.render(reply) == "recording stopped: 3 request(s), 10 bytes in /x"

