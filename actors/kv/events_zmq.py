"""KV cache events on the wire, as vLLM publishes them: a ZMQ PUB socket and a replay socket.

Each engine iteration's events (``events.EventBatch``: ``BlockStored`` / ``BlockRemoved``
/ ``AllBlocksCleared``, encoded by ``events_wire.py``: vLLM's tagged maps or positional
arrays, 64-bit hashes, an integer data-parallel rank) go out as one three-frame message:

    [topic (utf-8), sequence number (8 bytes, big-endian), msgpack payload]

The topic defaults to ``kv@<host:port>@<served model name>``, the form llm-d's subscriber
splits into a pod identity and a model name (``default_topic``).

Sequence numbers start at 0 and increase by one per batch, so a subscriber sees a gap when
it misses one. The last ``buffer_steps`` batches are kept for replay: a client sends, to
the ROUTER socket at ``replay_endpoint``, the first sequence number it wants (8 bytes,
big-endian, after an empty delimiter frame as REQ sockets send it) and gets back every
buffered batch from there as ``[sequence, payload]`` frames, then ``[-1 (8 bytes, signed),
b""]``. This is the contract KV-aware routers (Dynamo's, llm-d's KV cache manager) consume
from vLLM, so they can index tokenloom workers unchanged.

Like vLLM: the PUB endpoint is bound when it names a wildcard host (``tcp://*:5557``) or
an ``ipc://`` / ``inproc://`` path and connected otherwise; the replay socket is always
bound. Publishing never blocks the KV manager: batches go through a bounded queue to a
sender thread, and a full queue drops (and counts) the batch — subscribers see the gap
and replay can no longer fill it, as with a slow PUB subscriber under its high-water mark.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections import deque
from itertools import count
from pathlib import Path

import structlog
import zmq

from tokenloom.actors.kv.events import AllBlocksCleared, EventBatch
from tokenloom.actors.kv.events_wire import WireEncoder

log = structlog.get_logger("tokenloom.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqKVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "", encoding: str = "map",
                 data_parallel_rank: int = 0):
        self.endpoint = endpoint
        self._wire = WireEncoder(encoding, data_parallel_rank)
        self.replay_endpoint = replay_endpoint or None
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self.num_published = 0
        self.num_dropped = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if _binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="tokenloom-kv-events",
                                        daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Queue one batch for sending (never blocks)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1

    def publish_cleared(self, ts: float) -> None:
        """A (re)started worker holds no cached blocks: say so first, so that a router that
        indexed this endpoint before forgets what it held."""
        self.publish(EventBatch(ts=ts, events=[AllBlocksCleared()]))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    # -- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        encode = self._wire.encode
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:   # counted as a gap; replay still has it
                log.warning("kv event publish failed", seq=seq, error=str(e))
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("bad kv event replay request", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def default_topic(host: str, port: int, served_model_name: str, model_dir: str) -> str:
    """``kv@<host:port>@<model>``: the pod identity and model name llm-d reads from a topic
    (``kv@<pod>@<model>``). A wildcard host says nothing about which pod this is, so the
    host name (a pod's name in Kubernetes) stands in for it; the model is the name clients
    send (``server.served_model_name``, else the model directory's name, as the HTTP API
    derives it)."""
    if host in ("0.0.0.0", "::", "*", ""):
        host = socket.gethostname()
    return f"kv@{host}:{port}@{served_model_name or Path(model_dir).name}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
