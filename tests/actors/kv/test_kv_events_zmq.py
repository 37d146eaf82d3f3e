"""KV cache events on a ZMQ PUB socket, read by subscribers written from the consumers'
published code (tests/kv_consumers.py: llm-d's and Dynamo's decoders, vLLM's structs) —
not from tokenloom's structs:
1. every engine iteration's events arrive as [topic, 8-byte big-endian sequence, msgpack
   batch] that llm-d and Dynamo both accept; sequence numbers are consecutive from 0, the
   first batch says AllBlocksCleared (a fresh worker holds nothing);
2. the block hashes announced as stored are exactly the (64-bit) hashes of the blocks a
   later request with the same prompt hits, and a flush announces that the cache is empty;
3. a subscriber that missed batches (it connected late) sees the gap and gets every
   missed batch back from the replay socket, in order, ended by sequence -1 (asked with
   a DEALER socket: the replay streams one message per batch, more than a REQ socket's
   single reply), each in the framing vLLM's replay uses: [seq, payload].
"""

from __future__ import annotations

import random
import time

import pytest
import zmq

from tokenloom import LLM, SamplingParams
from tokenloom.actors.scheduling.request import Request

from kv_consumers import VLLM_STRUCTS, dynamo_decode, llmd_decode, split_message, vllm_int_hash
from tinymodel import VOCAB, build_tiny_model

_VLLM_DECODE, BlockStored, BlockRemoved, AllBlocksCleared = VLLM_STRUCTS["map"]
END_SEQ = -1
BLOCK = 8


def DECODE(payload: bytes):
    """vLLM's structs decode it, and llm-d and Dynamo accept it."""
    llmd_decode(payload)
    dynamo_decode(payload)
    return _VLLM_DECODE.decode(payload)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-events-model")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=1), seed=4)
    return path


def receive(sub: zmq.Socket, timeout_ms: int = 5000):
    assert sub.poll(timeout_ms), "no KV event batch arrived"
    topic, seq, payload = split_message(sub.recv_multipart())
    return topic, seq, DECODE(payload)


def drain(sub: zmq.Socket, quiet_ms: int = 300) -> list:
    out = []
    while sub.poll(quiet_ms):
        _, seq, batch = receive(sub)
        out.append((seq, batch))
    return out


def test_events_on_the_wire_match_later_hits_and_replay_fills_gaps(model_dir, tmp_path):
    pub_ep, replay_ep = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@worker0@tiny")
    llm = LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
              cache_dir=str(tmp_path / "cache"), block_size=BLOCK,
              **{"kv_events.enable_kv_cache_events": True, "kv_events.endpoint": pub_ep,
                 "kv_events.replay_endpoint": replay_ep, "kv_events.topic": "kv@worker0@tiny"})
    late = None
    try:
        sub.connect(pub_ep)
        rng = random.Random(2)
        prompt = [rng.randrange(3, VOCAB) for _ in range(5 * BLOCK + 3)]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        # Wait until the subscription is live (PUB drops messages for joining subscribers),
        # then generate.
        first = []
        for _ in range(50):
            llm.generate([[rng.randrange(3, VOCAB) for _ in range(2 * BLOCK)]], params)
            first = drain(sub, 100)
            if first:
                break
        assert first, "the subscriber never got a batch"
        llm.generate([prompt], params)
        batches = first + drain(sub)
        seqs = [s for s, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs   # no gap

        stored = {h for _, b in batches for e in b.events if isinstance(e, BlockStored)
                  for h in e.block_hashes}
        for _, b in batches:
            for e in b.events:
                if isinstance(e, BlockStored):
                    assert e.block_size == BLOCK
                    assert len(e.token_ids) == BLOCK * len(e.block_hashes)
        # The same prompt again: the blocks it hits are exactly announced ones.
        out = llm.generate([prompt], params)[0]
        hit_blocks = out.outputs[0].timings.num_cached_tokens // BLOCK
        assert hit_blocks == 5
        query = llm.engine.scheduler.core.prefix.query(
            Request("probe", prompt, params, max_model_len=1024))
        assert {vllm_int_hash(h) for h in query.block_hashes[:hit_blocks]} <= stored

        # A flush announces that the cache is empty (or, were anything left, which blocks
        # went).
        llm.flush_cache(force=True)
        events = [e for _, b in drain(sub) for e in b.events]
        removed = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
        assert any(isinstance(e, AllBlocksCleared) for e in events) or \
            {vllm_int_hash(h) for h in query.block_hashes[:hit_blocks]} <= removed, events

        # A subscriber that connects late misses the start: the replay socket has it all.
        late = ctx.socket(zmq.SUB)
        late.setsockopt(zmq.SUBSCRIBE, b"")
        late.connect(pub_ep)
        got = []
        for _ in range(50):
            llm.generate([[rng.randrange(3, VOCAB) for _ in range(2 * BLOCK)]], params)
            got = drain(late, 100)
            if got:
                break
        assert got and got[0][0] > 0, "the late subscriber should have missed the start"
        req = ctx.socket(zmq.DEALER)
        req.connect(replay_ep)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert req.poll(5000), "replay did not answer"
            _, seq_bytes, payload = req.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                break
            replayed.append((seq, DECODE(payload)))
        req.close(linger=0)
        assert [s for s, _ in replayed][: got[0][0]] == list(range(got[0][0]))
        assert isinstance(replayed[0][1].events[0], AllBlocksCleared)
    finally:
        llm.close()
        sub.close(linger=0)
        if late is not None:
            late.close(linger=0)


def test_replay_from_the_middle_and_a_malformed_request(tmp_path):
    from tokenloom.actors.kv import events as ours
    from tokenloom.actors.kv.events_zmq import ZmqKVEventPublisher
    pub = ZmqKVEventPublisher(f"ipc://{tmp_path}/p.sock", f"ipc://{tmp_path}/r.sock",
                              buffer_steps=4, topic="t")
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/r.sock")
    try:
        for i in range(6):
            pub.publish(ours.EventBatch(ts=float(i), events=[ours.BlockRemoved(
                block_hashes=[bytes([i]) * 4])]))
        deadline = time.monotonic() + 10
        while pub.num_published < 6:                   # all sent before asking
            assert time.monotonic() < deadline
            time.sleep(0.01)
        dealer.send_multipart((b"", b"bad"))          # ignored, not fatal
        dealer.send_multipart((b"", (3).to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(5000)
            _, seq, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_SEQ:
                break
            got.append((seq, DECODE(payload).ts))
        # buffer_steps=4 keeps sequences 2..5; asked from 3 (the first batch is number 0)
        assert got == [(3, 3.0), (4, 4.0), (5, 5.0)]
        assert pub.num_published == 6 and pub.num_dropped == 0
    finally:
        dealer.close(linger=0)
        pub.shutdown()


def test_endpoints_are_validated():
    from tokenloom.config.load import load_config
    from tokenloom.config.schema import ConfigError
    with pytest.raises(ConfigError, match="kv_events.endpoint must be a ZMQ endpoint"):
        load_config(overrides={"kv_events.endpoint": "localhost:5557"}, env=None)
