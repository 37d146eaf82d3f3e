"""A live server's KV events, indexed the way external KV-aware routers index them, predict
the prefix-cache hits the server then reports (tests/kv_consumers.py has each consumer's
rules and the source file of each).

Two external indexes are built only from the decoded wire bytes: llm-d's (request keys
chained over the announced token ids, the parent found through the announced engine
hashes, every string of a block's ``extra_keys`` folded in — so a ``cache_salt`` keys a
chain apart) and Dynamo's (a radix tree of the announced hashes, edges labelled by each
block's tokens, lora name and cache namespace, the namespace read from a
``dynamo-cache-salt:``-prefixed salt in the first block's extra keys, as Dynamo's own
frontend sends salts). Neither reproduces tokenloom's hash: both key blocks by what the
events say (token ids, extra keys, parent links), which is the point of the check.

1. a SUB socket subscribed to llm-d's default filter ``kv@`` receives batches whose topic
   (the default ``kv@<host:port>@<served model name>``) names the served model, with data
   parallel rank 0, accepted by both decoders, no store dropped for an unknown parent;
2. prompts are served with and without a ``cache_salt``;
3. for each follow-up sharing a prefix (unsalted, the same salt, another salt, the whole
   prompt again), both indexes predict ``usage.prompt_tokens_details.cached_tokens``
   exactly before the request is sent (the block holding the last prompt token is never
   a hit); another salt predicts, and gets, 0.
"""

from __future__ import annotations

import random

import pytest
import zmq

from client import post
from kv_consumers import (
    DYNAMO_SALT_PREFIX,
    DynamoIndex,
    LlmdIndex,
    dynamo_decode,
    llmd_decode,
    llmd_topic,
    split_message,
)
from servers import ServerThread, tiny_config
from tinymodel import VOCAB

BS = 8   # tiny_config's cache.block_size
SALT1, SALT2 = DYNAMO_SALT_PREFIX + "tenant-1", DYNAMO_SALT_PREFIX + "tenant-2"


@pytest.fixture(scope="module")
def kv_server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-events")
    endpoint = f"ipc://{tmp}/kv.sock"
    s = ServerThread(tiny_config(tiny_model_dir, tmp / "cache",
                                 **{"kv_events.enable_kv_cache_events": True,
                                    "kv_events.endpoint": endpoint}))
    s.kv_endpoint = endpoint
    yield s
    s.close()


class Subscriber:
    """The wire, decoded by llm-d's and Dynamo's rules into their indexes."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sock.connect(endpoint)
        self.llmd, self.dynamo = LlmdIndex(BS), DynamoIndex(BS)
        self.topics: set[str] = set()
        self.ranks: set = set()
        self.seqs: list[int] = []

    def drain(self, quiet_ms: int = 300) -> int:
        n = 0
        while self.sock.poll(quiet_ms):
            topic, seq, payload = split_message(self.sock.recv_multipart())
            pod, model = llmd_topic(topic)
            _, rank, events = llmd_decode(payload)
            self.llmd.apply(pod, model, events)
            _, dyn_rank, dyn_events = dynamo_decode(payload)
            self.dynamo.apply(dyn_events)
            self.topics.add(topic)
            self.ranks.update((rank, dyn_rank))
            self.seqs.append(seq)
            n += 1
        return n


def complete(server, model, tokens, salt=None) -> int:
    body = dict(model=model, prompt=tokens, max_tokens=2, temperature=0, ignore_eos=True)
    if salt is not None:
        body["cache_salt"] = salt
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    server.wait_idle()          # the request's last blocks are committed before its free
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_an_external_index_of_the_events_predicts_cached_tokens(kv_server, model_name):
    sub = Subscriber(kv_server.kv_endpoint)
    rng = random.Random(5)
    try:
        # PUB drops what it sends before a subscription is live: serve until a batch arrives.
        for _ in range(50):
            complete(kv_server, model_name, [rng.randrange(3, VOCAB) for _ in range(2 * BS)])
            if sub.drain(100):
                break
        assert sub.seqs, "no KV event batch arrived"
        pod, model = llmd_topic(sub.topics.pop())
        assert model == model_name and pod.endswith(":8000")
        sub.topics.add(f"kv@{pod}@{model}")

        prompt = [rng.randrange(3, VOCAB) for _ in range(6 * BS + 3)]
        complete(kv_server, model_name, prompt)
        complete(kv_server, model_name, prompt, SALT1)
        sub.drain()
        tail = [rng.randrange(3, VOCAB) for _ in range(BS + 2)]
        follow_ups = [("unsalted", prompt[:5 * BS + 2] + tail, None),
                      ("same salt", prompt[:5 * BS + 2] + tail, SALT1),
                      ("other salt", prompt[:5 * BS + 2] + tail, SALT2),
                      ("whole prompt", prompt, None)]
        got = {}
        for name, tokens, salt in follow_ups:
            reusable = (len(tokens) - 1) // BS
            extra = (salt,) if salt is not None else ()
            namespace = salt[len(DYNAMO_SALT_PREFIX):] if salt else None
            llmd = min(sub.llmd.hit_blocks(pod, tokens, model, extra), reusable) * BS
            dynamo = min(sub.dynamo.hit_blocks(tokens, namespace=namespace), reusable) * BS
            actual = complete(kv_server, model_name, tokens, salt)
            got[name] = (llmd, dynamo, actual)
            sub.drain()
        assert got == {"unsalted": (5 * BS,) * 3, "same salt": (5 * BS,) * 3,
                       "other salt": (0, 0, 0), "whole prompt": (6 * BS,) * 3}, got
        assert sub.llmd.skipped == [] and sub.dynamo.dropped == []
        assert sub.ranks == {0}
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no gap
        assert len(sub.topics) == 1
    finally:
        sub.sock.close(linger=0)
