"""The external consumers of KV cache events, re-implemented from their published decoders so
that tests read tokenloom's wire bytes the way they do — with plain ``msgpack`` into lists
and dicts, never with tokenloom's own structs. Each rule names the file it comes from:

llm-d (``llm-d/llm-d-router``, formerly ``llm-d-kv-cache-manager``):
- ``pkg/kvevents/engineadapter/vllm_adapter.go``: three frames ``[topic, seq, payload]``, seq
  8 bytes big-endian; the topic splits on ``@`` into ``kv@<pod>@<model>``; the batch is an
  ``array`` struct ``[ts, events, dp_rank?]``; an event is a positional array with the tag
  first or a map tagged under ``"type"`` (``mapEventToFields``, field order
  ``blockStoredFieldOrder``); one bad event fails the whole batch.
- ``engineadapter/common.go`` ``getHashAsUint64``: a hash is a uint64/int64, or bytes folded
  to their last 8 bytes big-endian; anything else fails the batch.
- ``pkg/kvevents/pool.go`` ``DefaultConfig``: the subscription filter is ``"kv@"``;
  ``processEventBatch``: a store whose parent engine key has no request key is skipped;
  request keys chain the tokens on the parent's request key with the block's extra
  features, under ``lora_name`` when set, else the topic's model; a store with a
  ``group_idx`` is indexed only for a prefix-indexable ``kv_cache_spec_kind`` and a dense
  span (``len(token_ids) == len(block_hashes) * block_size``); ``AllBlocksCleared`` clears
  the pod; the tier is the lower-cased ``medium`` (``"gpu"`` when absent).
- ``pkg/kvcache/kvblock`` ``ParseRawExtraKeys``: every string of a block's extra keys (and
  the string of a ``[string, int]`` pair) taints that block's key.
  (llm-d's key hash itself — its token processor's — is not reproduced: ``LlmdIndex`` keys
  with SHA-256 over the same inputs, which is what decides which keys are equal.)

Dynamo (``ai-dynamo/dynamo``, ``lib/kv-router/src/zmq_wire``):
- ``types.rs`` ``KvEventBatch``: the batch must be the tuple ``(f64, Vec<event>, Option<i32>)``;
  ``BlockHashValue`` is an untagged ``i64 | u64`` — a ``bytes`` hash fails the batch;
  ``token_ids`` are u32; ``ExtraKeyItem`` is a string, bytes, number, bool or
  ``(string, int)``.
- ``deserialize.rs``: an event is a tagged map (by field name, unknown keys ignored;
  ``block_hashes``/``token_ids``/``block_size`` required) or a positional sequence (tag,
  hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys, tail);
  an unknown tag fails the batch; a map's top-level ``cache_salt`` is the cache namespace.
- ``extra_keys.rs`` ``extra_keys_to_cache_namespace``: otherwise the namespace is a
  ``"dynamo-cache-salt:"``-prefixed string in the FIRST block's extra keys (Dynamo's vLLM
  handler sends salts so prefixed); ``mod.rs`` ``propagate_cache_namespace``: a store
  without one inherits its parent's.
- ``convert.rs``: a store repeating a hash (parent included) is dropped; a block whose
  ``block_size`` is not the router's ``kv_block_size``, or whose tokens are missing, stops
  the store; each block's ``tokens_hash`` covers its own tokens, ``lora_name`` and namespace
  (not chained: the radix tree chains through the parent's external hash).

vLLM (``vllm/distributed/kv_events.py``; ``vllm/v1/core/block_pool.py``
``_build_block_stored_event``; ``kv_cache_utils.py`` ``generate_block_hash_extra_keys``,
``maybe_convert_block_hash``): ``VLLM_STRUCTS`` below are its types field for field
(``ExternalBlockHash = bytes | int``), as its own ``kv_events_subscriber.py`` example
decodes them; ``extra_keys`` has one entry per block, the ``cache_salt`` in a sequence's
first block; an int hash is the digest's last 8 bytes big-endian.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Any

import msgpack
import msgspec

U64 = (1 << 64) - 1


class Rejected(Exception):
    """The consumer drops this message, batch or event."""


def unpack(payload: bytes):
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def split_message(frames: list[bytes]) -> tuple[str, int, bytes]:
    """[topic, seq, payload] -> (topic, seq, payload) (vllm_adapter.go parseVLLMMessage)."""
    if len(frames) != 3:
        raise Rejected(f"expected 3 message parts, got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise Rejected(f"invalid sequence bytes length: {len(seq)}")
    return topic.decode(), int.from_bytes(seq, "big"), payload


def vllm_int_hash(digest: bytes) -> int:
    """vLLM's maybe_convert_block_hash with int hashes on (its default)."""
    return int.from_bytes(digest[-8:], "big")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- llm-d ------------------------------------------------------------------------------------
LLMD_TOPIC_FILTER = "kv@"
_LLMD_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                "kv_cache_spec_sliding_window")
_LLMD_REMOVED = ("block_hashes", "medium", "group_idx")
_LLMD_INDEXABLE = {"full_attention", "mla_attention", "sink_full"}


def llmd_topic(topic: str) -> tuple[str, str]:
    if not topic.startswith(LLMD_TOPIC_FILTER):
        raise Rejected(f"topic {topic!r} does not match the subscription filter 'kv@'")
    parts = topic.split("@")
    if len(parts) != 3:
        raise Rejected(f"topic {topic!r} is not kv@<pod>@<model>")
    return parts[1], parts[2]


def llmd_hash(raw) -> int:
    if _is_int(raw):
        return raw & U64
    if isinstance(raw, bytes) and raw:
        return int.from_bytes(raw[-8:].rjust(8, b"\0"), "big")
    raise Rejected(f"unsupported hash type: {type(raw).__name__}")


def _opt(fields, i, kind, name):
    value = fields[i] if i < len(fields) else None
    if value is not None and not kind(value):
        raise Rejected(f"{name} has the wrong type: {type(value).__name__}")
    return value


def llmd_decode(payload: bytes) -> tuple[float, int | None, list[dict]]:
    """(ts, dp_rank, events), events normalized like llm-d's generic events."""
    batch = unpack(payload)
    if not isinstance(batch, list) or len(batch) < 2:
        raise Rejected("the batch is not an array [ts, events, dp_rank]")
    ts, raw_events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 else None
    if not isinstance(ts, (int, float)) or not isinstance(raw_events, list) or \
            (rank is not None and not _is_int(rank)):
        raise Rejected("bad batch field types")
    out = []
    for ev in raw_events:
        if isinstance(ev, dict):
            tag = ev.get("type")
            if not isinstance(tag, str):
                raise Rejected("map-encoded event without a string 'type'")
            order = {"BlockStored": _LLMD_STORED, "BlockRemoved": _LLMD_REMOVED}.get(tag, ())
            fields = [tag] + [ev.get(name) for name in order]
        elif isinstance(ev, list) and ev and isinstance(ev[0], str):
            fields = ev
        else:
            raise Rejected("event is neither a tagged array nor a tagged map")
        tag = fields[0]
        if tag == "BlockStored":
            if len(fields) < 5:
                raise Rejected("BlockStored: need at least 5 fields")
            if not isinstance(fields[1], list) or not isinstance(fields[3], list):
                raise Rejected("BlockStored: block_hashes / token_ids not arrays")
            if not all(_is_int(t) for t in fields[3]) or not _is_int(fields[4]):
                raise Rejected("BlockStored: token_ids / block_size not integers")
            extra = _opt(fields, 8, lambda v: isinstance(v, list) and all(
                k is None or isinstance(k, list) for k in v), "extra_keys")
            group = _opt(fields, 9, lambda v: _is_int(v) and v >= 0, "group_idx")
            medium = _opt(fields, 6, lambda v: isinstance(v, str), "medium")
            out.append(dict(
                type=tag, hashes=[llmd_hash(h) for h in fields[1]],
                parent=0 if fields[2] is None else llmd_hash(fields[2]),
                tokens=[t & 0xFFFFFFFF for t in fields[3]], block_size=fields[4],
                lora_id=_opt(fields, 5, _is_int, "lora_id"),
                tier=(medium or "gpu").lower(),
                lora_name=_opt(fields, 7, lambda v: isinstance(v, str), "lora_name"),
                extra_keys=extra, group_idx=group,
                spec_kind=_opt(fields, 10, lambda v: isinstance(v, str), "kv_cache_spec_kind")))
        elif tag == "BlockRemoved":
            if len(fields) < 2 or not isinstance(fields[1], list):
                raise Rejected("BlockRemoved: block_hashes not an array")
            medium = _opt(fields, 2, lambda v: isinstance(v, str), "medium")
            out.append(dict(type=tag, hashes=[llmd_hash(h) for h in fields[1]],
                            tier=(medium or "gpu").lower()))
        elif tag == "AllBlocksCleared":
            out.append(dict(type=tag))
        else:
            raise Rejected(f"unknown vLLM event tag: {tag}")
    return float(ts), rank, out


def _llmd_features(block_keys) -> tuple[str, ...]:
    """ParseRawExtraKeys: the strings of one block's extra keys (bare or in [str, int])."""
    out = []
    for k in block_keys or ():
        if isinstance(k, str):
            out.append(k)
        elif isinstance(k, list) and k and isinstance(k[0], str):
            out.append(k[0])
    return tuple(out)


class LlmdIndex:
    """llm-d's index fed by its event pool: request key -> pods, engine key -> request key."""

    def __init__(self, block_size: int):
        self.block_size = block_size       # the token processor's (canonical) block size
        self.request_of: dict[int, bytes] = {}
        self.pods: dict[bytes, set[tuple[str, str]]] = defaultdict(set)
        self.skipped: list[str] = []

    def request_keys(self, parent: bytes, tokens: list[int], model: str,
                     features: list[tuple[str, ...]] | None) -> list[bytes]:
        keys, bs = [], self.block_size
        for i in range(len(tokens) // bs):
            extra = features[i] if features and i < len(features) else ()
            parent = hashlib.sha256(msgpack.packb(
                [parent, model, tokens[i * bs:(i + 1) * bs], list(extra)])).digest()
            keys.append(parent)
        return keys

    def apply(self, pod: str, model: str, events: list[dict]) -> None:
        for ev in events:
            if ev["type"] == "BlockStored":
                self._store(pod, model, ev)
            elif ev["type"] == "BlockRemoved":
                for h in ev["hashes"]:
                    key = self.request_of.get(h)
                    if key is not None:
                        self.pods[key].discard((pod, ev["tier"]))
            else:
                for holders in self.pods.values():
                    for entry in [e for e in holders if e[0] == pod]:
                        holders.discard(entry)

    def _store(self, pod: str, model: str, ev: dict) -> None:
        if ev["group_idx"] is not None and (ev["spec_kind"] not in _LLMD_INDEXABLE or len(
                ev["tokens"]) != len(ev["hashes"]) * ev["block_size"]):
            self.skipped.append("not digestible")
            return
        parent = b""
        if ev["parent"] != 0:
            if ev["parent"] not in self.request_of:
                self.skipped.append(f"unknown parent {ev['parent']:#x}")
                return
            parent = self.request_of[ev["parent"]]
        features = ([_llmd_features(k) for k in ev["extra_keys"]]
                    if ev["extra_keys"] is not None else None)
        keys = self.request_keys(parent, ev["tokens"], ev["lora_name"] or model, features)
        for engine_key, key in zip(ev["hashes"], keys):
            self.request_of[engine_key] = key
            self.pods[key].add((pod, ev["tier"]))

    def hit_blocks(self, pod: str, tokens: list[int], model: str,
                   first_block_extra: tuple[str, ...] = ()) -> int:
        """Leading blocks of a prompt this pod holds, the prompt keyed like an event's
        chain (the request's extra keys in its first block, as vLLM puts them)."""
        n = len(tokens) // self.block_size
        features = [first_block_extra] + [()] * (n - 1) if n else []
        hits = 0
        for key in self.request_keys(b"", tokens, model, features):
            if not any(p == pod for p, _ in self.pods.get(key, ())):
                break
            hits += 1
        return hits


# -- Dynamo -----------------------------------------------------------------------------------
DYNAMO_SALT_PREFIX = "dynamo-cache-salt:"


def _dynamo_hash(raw) -> int:
    if _is_int(raw) and -(1 << 63) <= raw <= U64:
        return raw & U64
    raise Rejected(f"block hash must be i64 or u64, got {type(raw).__name__}")


def _dynamo_extra_item(item) -> bool:
    if isinstance(item, (str, bytes, int, float, bool)):
        return True
    return isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and \
        _is_int(item[1])


def dynamo_decode(payload: bytes) -> tuple[float, int | None, list[dict]]:
    batch = unpack(payload)
    if not isinstance(batch, list) or len(batch) != 3:
        raise Rejected("the batch must be the 3-tuple [ts, events, data_parallel_rank]")
    ts, raw_events, rank = batch
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or \
            not isinstance(raw_events, list):
        raise Rejected("bad batch field types")
    if rank is not None and not (_is_int(rank) and -(1 << 31) <= rank < (1 << 31)):
        raise Rejected("data_parallel_rank must be an i32 or nil")
    return float(ts), rank, [_dynamo_event(ev) for ev in raw_events]


def _dynamo_event(ev) -> dict:
    if isinstance(ev, dict):
        tag = ev.get("type")
        get = ev.get
        if tag == "BlockStored":
            for name in ("block_hashes", "token_ids", "block_size"):
                if name not in ev:
                    raise Rejected(f"missing field {name}")
        elif tag == "BlockRemoved" and "block_hashes" not in ev:
            raise Rejected("missing field block_hashes")
        namespace = ev.get("cache_salt")
    elif isinstance(ev, list) and ev and isinstance(ev[0], str):
        tag = ev[0]
        names = (("type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                  "lora_id", "medium", "lora_name", "extra_keys") if tag == "BlockStored"
                 else ("type", "block_hashes", "medium"))
        if tag == "BlockStored" and len(ev) < 5 or tag == "BlockRemoved" and len(ev) < 2:
            raise Rejected(f"{tag}: missing positional fields")
        positional = dict(zip(names, ev))
        get = positional.get
        namespace = None
    else:
        raise Rejected("a kv event must be a tagged map or sequence")
    if tag == "AllBlocksCleared":
        return dict(type=tag)
    if tag not in ("BlockStored", "BlockRemoved"):
        raise Rejected(f"unknown variant {tag!r}")
    if not isinstance(get("block_hashes"), list):
        raise Rejected("block_hashes must be a sequence")
    out = dict(type=tag, hashes=[_dynamo_hash(h) for h in get("block_hashes")])
    medium = get("medium")
    if medium is not None and not isinstance(medium, str):
        raise Rejected("medium must be a string")
    out["medium"] = medium
    if tag == "BlockRemoved":
        return out
    parent, tokens, bs = get("parent_block_hash"), get("token_ids"), get("block_size")
    lora_name, extra = get("lora_name"), get("extra_keys")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < (1 << 32)
                                               for t in tokens):
        raise Rejected("token_ids must be u32s")
    if not (_is_int(bs) and bs >= 0) or (lora_name is not None and not isinstance(lora_name, str)):
        raise Rejected("bad block_size / lora_name")
    if extra is not None and not (isinstance(extra, list) and all(
            k is None or (isinstance(k, list) and all(_dynamo_extra_item(i) for i in k))
            for k in extra)):
        raise Rejected("extra_keys must be a list of (list of extra key items | nil)")
    if namespace is None and extra:
        unmatched_lora = lora_name or None
        for item in extra[0] or ():
            if not isinstance(item, str):
                continue
            if unmatched_lora is not None and item == unmatched_lora:
                unmatched_lora = None
                continue
            if item.startswith(DYNAMO_SALT_PREFIX) and len(item) > len(DYNAMO_SALT_PREFIX):
                namespace = item[len(DYNAMO_SALT_PREFIX):]
                break
    out.update(parent=None if parent is None else _dynamo_hash(parent), tokens=tokens,
               block_size=bs, lora_name=lora_name, namespace=namespace or None)
    return out


class DynamoIndex:
    """Dynamo's radix tree for one worker: an external block hash is a node under its
    parent's; edges are labelled by the block's ``tokens_hash``."""

    ROOT = -1

    def __init__(self, kv_block_size: int):
        self.kv_block_size = kv_block_size
        self.children: dict[int, dict[bytes, int]] = defaultdict(dict)
        self.nodes: dict[int, tuple[int, bytes]] = {}      # hash -> (parent, tokens_hash)
        self.namespace_of: dict[int, str] = {}
        self.dropped: list[str] = []

    @staticmethod
    def tokens_hash(tokens, lora_name, namespace) -> bytes:
        return hashlib.sha256(msgpack.packb([list(tokens), lora_name, namespace])).digest()

    def apply(self, events: list[dict]) -> None:
        for ev in events:
            if ev["type"] == "BlockStored":
                self._store(ev)
            elif ev["type"] == "BlockRemoved":
                for h in ev["hashes"]:
                    node = self.nodes.pop(h, None)
                    self.namespace_of.pop(h, None)
                    if node is not None:
                        self.children[node[0]].pop(node[1], None)
            else:
                self.children.clear()
                self.nodes.clear()
                self.namespace_of.clear()

    def _store(self, ev: dict) -> None:
        seen = [ev["parent"]] if ev["parent"] is not None else []
        if len(set(seen + ev["hashes"])) != len(seen) + len(ev["hashes"]):
            self.dropped.append("self-referencing block")
            return
        namespace = ev["namespace"]
        if namespace is None and ev["parent"] is not None:
            namespace = self.namespace_of.get(ev["parent"])
        parent = self.ROOT if ev["parent"] is None else ev["parent"]
        if parent != self.ROOT and parent not in self.nodes:
            self.dropped.append(f"parent {parent:#x} not found")
            return
        bs, offset = ev["block_size"], 0
        for h in ev["hashes"]:
            if bs != self.kv_block_size or offset + bs > len(ev["tokens"]):
                self.dropped.append("block not published")
                break
            th = self.tokens_hash(ev["tokens"][offset:offset + bs], ev["lora_name"], namespace)
            self.nodes[h] = (parent, th)
            self.children[parent][th] = h
            if namespace is not None:
                self.namespace_of[h] = namespace
            parent, offset = h, offset + bs

    def hit_blocks(self, tokens: list[int], lora_name: str | None = None,
                   namespace: str | None = None) -> int:
        node, hits, bs = self.ROOT, 0, self.kv_block_size
        for i in range(len(tokens) // bs):
            child = self.children.get(node, {}).get(
                self.tokens_hash(tokens[i * bs:(i + 1) * bs], lora_name, namespace))
            if child is None:
                break
            node, hits = child, hits + 1
        return hits


# -- vLLM's own structs -----------------------------------------------------------------------
ExternalBlockHash = bytes | int


def _vllm_structs(array_like: bool):
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    # (built with defstruct: these classes are local, string annotations could not name them)
    KVEventBatch = msgspec.defstruct(
        "KVEventBatch", [("ts", float),
                         ("events", list[BlockStored | BlockRemoved | AllBlocksCleared]),
                         ("data_parallel_rank", int | None, None)],
        array_like=True, omit_defaults=True, gc=False)
    return msgspec.msgpack.Decoder(KVEventBatch), BlockStored, BlockRemoved, AllBlocksCleared


VLLM_STRUCTS = {"map": _vllm_structs(array_like=False), "array": _vllm_structs(array_like=True)}
