"""Issue 30's "done when", on the default model (SmolLM2-135M-Instruct): a capture recorded
from live traffic, replayed before and after a planted chat-template change, yields the
incident sentence naming the mechanism, and the HTML report opens in a real browser.

1. serve SmolLM2 with its own chat template (v16) and record live chat traffic over the
   admin socket (stable system prompt with a tool schema; each user message starts with a
   volatile `request_id=... time=...` line)
2. serve a copy whose template v17 moves that metadata line ahead of the system prompt
3. replay the capture against both servers
4. the diagnosis's top mechanism is the prompt layout, the sentence says p95 TTFT regressed
   because of it with the hit rates, and the prefix diff shows the metadata at the divergence
5. the HTML report, screenshotted in headless Chromium, shows the plots.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request

import pytest

from tokenloom.daemon.admin import cli as admin_cli
from tokenloom.daemon.admin import protocol as P
from tokenloom.daemon.debug import capture as C
from tokenloom.daemon.debug import replay as R
from tokenloom.daemon.debug import report
from tokenloom.daemon.debug.diagnose import diagnose

SYSTEM = (
    "You are the support assistant of an online shop. Policy: refunds are accepted within 30 "
    "days of delivery with the receipt; exchanges within 60 days; items on sale are final. "
    "Shipping takes 3 to 5 business days; express shipping takes 1 to 2. Never promise a "
    "delivery date the carrier has not confirmed. Escalate to a human when the customer asks "
    "twice. Tools: lookup_order(order_id: string) returns the order's status, items and "
    "tracking number; refund(order_id: string, reason: string) starts a refund; "
    "exchange(order_id: string, item: string) starts an exchange. Answer in at most two "
    "sentences, in the customer's language, and call a tool only when the answer needs it.")
QUESTIONS = ["Where is my order?", "Can I return the blue shirt?", "How long does shipping take?",
             "I want a refund for a broken lamp.", "Can I exchange shoes for a larger size?",
             "Is the sale final?", "Has my parcel left the warehouse?", "Do you ship abroad?"]

# v17: the first line of the last message (the request metadata) is rendered first, as its
# own system block, and the message without it: volatile content ahead of the stable prefix.
V17 = ("{{ '<|im_start|>system\\n' + messages[-1]['content'].split('\\n')[0] + "
       "'<|im_end|>\\n' }}{% for message in messages %}{% if loop.last %}{{ '<|im_start|>' + "
       "message['role'] + '\\n' + message['content'].split('\\n', 1)[1] + '<|im_end|>\\n' }}"
       "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
       "'<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
       "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def template_v17(model_dir, path):
    path.mkdir()
    for name in os.listdir(model_dir):
        if name != "chat_template.jinja":
            (path / name).symlink_to(model_dir / name)
    (path / "chat_template.jinja").write_text(V17)
    return path


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def serve(model_dir, cache, **overrides):
    from servers import ServerThread, tiny_config
    return ServerThread(tiny_config(model_dir, cache, **{"cache.block_size": 16,
                                                         "cache.num_blocks": 2048,
                                                         **overrides}))


def replay(server, capture, out):
    server.call(server.engine.flush_prefix_cache(force=True))
    asyncio.run(R.run(capture, server.url, out))
    cap = C.load(out)
    assert all(r["status"] == 200 and not r["error"] for r in cap.records), cap.records[:1]
    return cap


@pytest.mark.slow
def test_template_change_on_the_default_model(default_model_dir, tmp_path):
    import numpy as np
    import screenshot
    from transformers import AutoTokenizer

    from tokenloom.daemon.debug.svg import COLORS

    capture = tmp_path / "live.jsonl"
    sock = tmp_path / "admin.sock"
    v16 = serve(default_model_dir, tmp_path / "cache", **{"admin.socket_path": str(sock)})
    try:
        with urllib.request.urlopen(v16.url + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        reply = admin_cli.send(str(sock), P.RecordStart(path=str(capture)))
        assert isinstance(reply, P.RecordReply) and reply.recording, reply
        for i in range(16):
            meta = f"request_id={0x8f3a2c01 + 7919 * i:x} time=2026-12-01T22:{10 + i}:07Z"
            post(v16.url, {"model": model, "max_tokens": 4, "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{meta}\n{QUESTIONS[i % len(QUESTIONS)]}"}]})
            time.sleep(0.05)
        stopped = admin_cli.send(str(sock), P.RecordStop())
        assert stopped.requests == 16, stopped
        before = replay(v16, capture, tmp_path / "v16.jsonl")
    finally:
        v16.close()
    v17 = serve(template_v17(default_model_dir, tmp_path / "smollm2-v17"), tmp_path / "cache")
    try:
        after = replay(v17, capture, tmp_path / "v17.jsonl")
    finally:
        v17.close()

    d = diagnose(before, after, names=("template v16", "template v17"))
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = report.text(d, tokenizer)
    assert d.top is not None and d.top.name == "prefix_layout", text
    assert d.ttft.verdict == "regressed", text
    s = d.sentence
    assert s.startswith("p95 TTFT regressed") and "because the prompt layout moved" in s, s
    hit_b, hit_a = d.top.figures["hit_rate"]
    assert hit_b > 0.7 and hit_a < 0.2, text
    assert f"prefix-cache hits fell {round(100 * hit_b)}%" in s
    assert "request_id" in text.split("Token-level prefix diff")[1], text
    print(text)

    page, png = tmp_path / "report.html", tmp_path / "report.png"
    page.write_text(report.html(d, tokenizer), encoding="utf-8")
    screenshot.screenshot(page, png)
    _, _, px = screenshot.png_rgb(png)
    assert (px.min(axis=2) < 240).mean() > 0.02
    for colour in COLORS[:2]:
        rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
        assert np.all(np.abs(px.astype(int) - rgb) < 12, axis=2).sum() > 500, colour
