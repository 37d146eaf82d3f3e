"""The tokenizer actor: big prompts are encoded off the event loop, and messages still leave
in inbox order (an abort never overtakes its add; a small request waits behind a big one).

Ordering and progress are asserted by counting and sequence, never by timing: the fake
tokenizer's big encode blocks on an event the test sets (releasing the GIL, as HF fast
tokenizers do), so the test decides when it ends."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tokenloom.actors.front.tokenizer_actor import INLINE_MAX_CHARS, TokenizerActor
from tokenloom.actors.messages import (
    ERROR_INVALID,
    AbortRequest,
    AddRequest,
    GenerateRequest,
    RequestOutput,
    Shutdown,
)
from tokenloom.actors.sampling_params import SamplingParams

BIG = "w5 w6 w7 " * 23_000   # ~200 KB, 69,000 words
assert len(BIG) > 200_000 and len(BIG) > INLINE_MAX_CHARS


class GatedTokenizer:
    """Word-level ("w17" -> 17). Encoding text longer than `big` blocks until `release` is
    set; every encode records the thread it ran on."""

    def __init__(self, big: int = 10_000):
        self.big = big
        self.started = threading.Event()   # a big encode is in progress
        self.release = threading.Event()
        self.threads: dict[str, int] = {}  # first word of the text -> thread ident

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        words = text.split()
        self.threads[words[0] if words else ""] = threading.get_ident()
        if len(text) > self.big:
            self.started.set()
            self.release.wait(10)  # a regression that encodes on the loop fails, not hangs
        return [int(w[1:]) for w in words]

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        if any(m.get("role") not in ("system", "user", "assistant") for m in messages):
            raise ValueError("roles must be system, user or assistant")
        return [3] + self.encode(" ".join(m["content"] for m in messages))


class Sink:
    """Stands for both the router's inbox and the stream registry, recording one sequence."""

    def __init__(self):
        self.events: list[tuple] = []
        self.forwarded: list = []

    def put_nowait(self, msg) -> None:
        self.forwarded.append(msg)
        self.events.append((type(msg).__name__, msg.request_id))

    def emit(self, out: RequestOutput) -> None:
        assert out.finished and out.finish_reason == "error" and out.error_kind == ERROR_INVALID
        self.events.append(("error", out.request_id, out.error_param))


def _actor(tokenizer, max_model_len: int = 1_000_000) -> tuple[TokenizerActor, Sink]:
    sink = Sink()
    actor = TokenizerActor(tokenizer, max_model_len, sink.emit, sink)
    return actor, sink


def _gen(rid: str, max_tokens: int = 4, **kw) -> GenerateRequest:
    return GenerateRequest(request_id=rid, sampling_params=SamplingParams(max_tokens=max_tokens),
                           **kw)


async def _until(cond, what: str) -> int:
    """Yield to the loop until `cond()`; returns how many times the loop came back to us.
    The deadline only turns a hang into a failure."""
    ticks = 0
    deadline = asyncio.get_running_loop().time() + 10
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0)
        ticks += 1
    return ticks


async def test_big_prompt_is_encoded_off_the_loop():
    """1. a 200 KB prompt starts encoding and blocks there; 2. meanwhile the loop keeps
    running (the ticker comes back 100 times) and nothing is forwarded; 3. released, its
    AddRequest arrives with all its tokens; the encode ran on another thread."""
    tok = GatedTokenizer()
    actor, sink = _actor(tok)
    task = asyncio.create_task(actor.run())
    actor.send(_gen("big", prompt=BIG))
    await _until(tok.started.is_set, "the big encode to start")
    ticks = 0
    while ticks < 100:
        await asyncio.sleep(0)
        ticks += 1
    assert sink.events == [] and not tok.release.is_set()
    tok.release.set()
    await _until(lambda: sink.events, "the big add")
    assert sink.events == [("AddRequest", "big")]
    assert tok.threads["w5"] != threading.get_ident()
    actor.send(Shutdown())
    await asyncio.wait_for(task, 10)


async def test_abort_and_small_requests_wait_behind_a_big_prompt():
    """1. big add, its abort, a small add (inline), its abort, a bad request, a chat request
    (worker), a bad chat; 2. while the big encode is blocked the small one is already encoded
    on the loop thread, yet nothing leaves; 3. released, everything leaves in inbox order."""
    tok = GatedTokenizer()
    actor, sink = _actor(tok)
    task = asyncio.create_task(actor.run())
    for msg in (_gen("big", prompt=BIG), AbortRequest(request_id="big"),
                _gen("small", prompt="w9 w10"), AbortRequest(request_id="small"),
                _gen("empty", prompt=""),
                _gen("chat", messages=[{"role": "user", "content": "w11 w12"}]),
                _gen("badchat", messages=[{"role": "robot", "content": "w13"}])):
        actor.send(msg)
    await _until(lambda: tok.started.is_set() and actor.inbox.empty(), "the inbox to be read")
    for _ in range(50):
        await asyncio.sleep(0)
    assert sink.events == []
    assert tok.threads["w9"] == threading.get_ident()  # cheap: inline
    tok.release.set()
    actor.send(Shutdown())  # ordered too: pending work is finished first
    await asyncio.wait_for(task, 10)
    assert sink.events == [
        ("AddRequest", "big"), ("AbortRequest", "big"),
        ("AddRequest", "small"), ("AbortRequest", "small"),
        ("error", "empty", "prompt"),
        ("AddRequest", "chat"),
        ("error", "badchat", "messages")]
    assert tok.threads["w11"] != threading.get_ident()  # chat templates go to the worker


async def test_shutdown_finishes_pending_work_and_cancel_drops_it():
    """1. Shutdown right behind a big add: run() returns only after the add is forwarded;
    2. a cancelled actor drops its pending big add, even once the encode completes."""
    tok = GatedTokenizer()
    tok.release.set()
    actor, sink = _actor(tok)
    actor.send(_gen("big", prompt=BIG))
    actor.send(Shutdown())
    actor.send(_gen("late", prompt="w4"))
    await asyncio.wait_for(actor.run(), 10)
    assert sink.events == [("AddRequest", "big")]

    tok = GatedTokenizer()
    actor, sink = _actor(tok)
    task = asyncio.create_task(actor.run())
    actor.send(_gen("big", prompt=BIG))
    actor.send(AbortRequest(request_id="big"))
    await _until(lambda: tok.started.is_set() and actor.inbox.empty(), "the big encode")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    tok.release.set()
    for _ in range(50):
        await asyncio.sleep(0)
    assert sink.events == []


@pytest.fixture(scope="module")
def hf_tokenizers(tmp_path_factory):
    """The tiny word-level tokenizer of tests/tinymodel.py as a real HF fast tokenizer, with
    its chat template and without one."""
    from transformers import AutoTokenizer

    from tinymodel import CHAT_TEMPLATE, save_tiny_tokenizer

    loaded = []
    for template in (CHAT_TEMPLATE, None):
        path = tmp_path_factory.mktemp("tok")
        save_tiny_tokenizer(path, template)
        loaded.append(AutoTokenizer.from_pretrained(path))
    return loaded


async def test_real_tokenizer_errors_end_only_their_request(hf_tokenizers):
    """A real HF tokenizer, on both paths: each bad request gets its error output naming the
    field; the good ones around them, a 200 KB chat included, flow in inbox order with the
    ids the tokenizer itself produces."""
    tok, _ = hf_tokenizers
    actor, sink = _actor(tok, max_model_len=100_000)
    big_chat = [{"role": "user", "content": BIG}]
    for msg in (_gen("empty", prompt=""), _gen("blank", prompt="   "),
                _gen("bigchat", messages=big_chat),
                _gen("vocab", prompt_token_ids=[5, 100_000]),
                _gen("toolong", prompt=BIG, max_tokens=99_000),  # 69,000 + 99,000 tokens
                _gen("ok", prompt="w5 w6"), AbortRequest(request_id="ok"), Shutdown()):
        actor.send(msg)
    await asyncio.wait_for(actor.run(), 30)
    assert sink.events == [
        ("error", "empty", "prompt"), ("error", "blank", "prompt"),
        ("AddRequest", "bigchat"),
        ("error", "vocab", "prompt"),
        ("error", "toolong", "max_tokens"),
        ("AddRequest", "ok"), ("AbortRequest", "ok")]
    adds = {m.request_id: m for m in sink.forwarded if isinstance(m, AddRequest)}
    assert adds["bigchat"].prompt_token_ids == list(tok.apply_chat_template(
        big_chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert adds["ok"].prompt_token_ids == tok.encode("w5 w6")


async def test_missing_chat_template_ends_only_its_request(hf_tokenizers):
    """A tokenizer without a chat template: the chat request ends with an error naming
    `messages` (from the worker thread); the text request behind it still flows."""
    _, no_template = hf_tokenizers
    actor, sink = _actor(no_template, max_model_len=512)
    for msg in (_gen("chat", messages=[{"role": "user", "content": "w5"}]),
                _gen("text", prompt="w5 w6"), Shutdown()):
        actor.send(msg)
    await asyncio.wait_for(actor.run(), 30)
    assert sink.events == [("error", "chat", "messages"), ("AddRequest", "text")]
