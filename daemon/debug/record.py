"""Recording live traffic as a capture (capture.py's format): `tokenloom admin record start
--out FILE` or `record.enabled` in the config.

The HTTP handler calls `Recorder.note(...)` once per finished request, only while recording
(`ServerState.recorder` is None otherwise: one attribute check per request). `note` puts a
tuple on a queue and returns; a writer thread turns it into a line (`make_record`: parsing
the body, tokenizing or hashing its prompt) and appends it. The file is bounded: past
`max_bytes` lines are dropped and counted, never blocking the server.

Content modes: `body` keeps the request body; `tokens` keeps its prompt token ids (the chat
template applied) and the other fields; `hashes` keeps only each full block's chain hash and
the prompt length, so a capture can leave the host without the text. Hashes are SHA-256
chains keyed by a secret drawn per capture and never written (short prompts cannot be
recovered by hashing guesses), with the request's cache_salt in the key, so requests share
hashes exactly where they shared a prefix (and a salt).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

from tokenloom.daemon.debug import capture as C

PROMPT_FIELDS = ("prompt", "messages", "tools")


def prompt_ids(tokenizer, endpoint: str, body: dict) -> list[int]:
    from tokenloom.daemon.debug.prefix_diff import tokenize_body
    if endpoint == "chat":
        return tokenize_body(tokenizer, {"messages": body.get("messages") or []})
    return tokenize_body(tokenizer, {"prompt": body.get("prompt")})


def block_hashes(ids: list[int], block_size: int, secret: bytes, salt: str | None) -> list[str]:
    from tokenloom.actors.kv.block_hash import CacheIdentity, hash_request_blocks
    identity = CacheIdentity(secret.hex(), salt).encode()
    return [h.hex() for h in hash_request_blocks(ids, block_size, identity)]


def make_record(*, t: float, endpoint: str, body: bytes | dict, content: str, status: int,
                error: str | None, usage: dict | None, metrics: dict | None,
                tenant: str | None, priority: int, salt: str | None = None, tokenizer=None,
                block_size: int = 16, secret: bytes = b"") -> dict:
    """One `request` line. `tokens` and `hashes` need the tokenizer. `salt`: the request's
    cache_salt (default: the body's)."""
    if isinstance(body, (bytes, bytearray)):
        body = json.loads(body)
    rec: dict = {"kind": "request", "t": round(t, 6), "endpoint": endpoint}
    salt = salt if salt is not None else body.get("cache_salt")
    if content == "body":
        rec["body"] = body
    else:
        ids = prompt_ids(tokenizer, endpoint, body)
        rec["params"] = {k: v for k, v in body.items() if k not in PROMPT_FIELDS}
        if content == "tokens":
            rec["prompt_token_ids"] = ids
        else:
            rec["blocks"] = {"hashes": block_hashes(ids, block_size, secret, salt),
                             "num_tokens": len(ids)}
            rec["params"].pop("user", None)
            rec["params"].pop("stop", None)
    rec.update({"salt": salt, "tenant": tenant, "priority": priority, "status": status,
                "error": error, "usage": usage, "metrics": metrics})
    return rec


class Recorder:
    """One capture being written. Thread-safe `note`; `stop` flushes and closes."""

    def __init__(self, path: str | Path, *, content: str = "body", max_bytes: int = 1 << 28,
                 tokenizer=None, block_size: int = 16, model: str = ""):
        if content not in C.CONTENT_MODES:
            raise ValueError(f"content must be one of {', '.join(C.CONTENT_MODES)}, "
                             f"got {content!r}")
        self.path = Path(path)
        self.content = content
        self.max_bytes = max_bytes
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.secret = os.urandom(16)
        self.start_mono = time.monotonic()
        self.started_at = time.time()
        self.written = 0
        self.dropped = 0
        self.bytes = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._file = open(self.path, "w", encoding="utf-8")
        self._write(C.dumps({"kind": "header", "source": "record", "version": C.VERSION,
                             "started_at": self.started_at, "content": content,
                             "block_size": block_size, "model": model}))
        self._thread = threading.Thread(target=self._loop, name="tokenloom-record",
                                        daemon=True)
        self._thread.start()

    def note(self, arrival: float, endpoint: str, body: bytes, status: int,
             error: str | None, usage: dict | None, metrics: dict | None,
             tenant: str | None, priority: int, salt: str | None = None) -> None:
        """Called on the event loop for each finished request: O(1), never blocks."""
        self._queue.put((arrival - self.start_mono, endpoint, body, status, error, usage,
                         metrics, tenant, priority, salt))

    def _write(self, line: str) -> bool:
        size = len(line.encode("utf-8"))
        if self.bytes + size > self.max_bytes:
            self.dropped += 1
            return False
        self._file.write(line)
        self.bytes += size
        return True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            t, endpoint, body, status, error, usage, metrics, tenant, priority, salt = item
            try:
                rec = make_record(t=t, endpoint=endpoint, body=body, content=self.content,
                                  status=status, error=error, usage=usage, metrics=metrics,
                                  tenant=tenant, priority=priority, salt=salt,
                                  tokenizer=self.tokenizer, block_size=self.block_size,
                                  secret=self.secret)
            except Exception as e:   # a body the server refused may not even be JSON
                rec = {"kind": "request", "t": round(t, 6), "endpoint": endpoint,
                       "status": status, "error": error or f"unrecordable body: {e}"}
            if self._write(C.dumps(rec)):
                self.written += 1
            self._file.flush()

    def stats(self) -> dict:
        return {"path": str(self.path), "content": self.content, "requests": self.written,
                "dropped": self.dropped, "bytes": self.bytes, "max_bytes": self.max_bytes,
                "seconds": round(time.monotonic() - self.start_mono, 3)}

    def stop(self) -> dict:
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._file.close()
        return self.stats()


def note_http(recorder: Recorder, gen, parsed, endpoint: str, body: bytes,
              error) -> None:
    """The HTTP handler's call (daemon/openai/handlers.py), made only while recording: the
    request as it finished. `error`: the APIError that refused it, None when it was served,
    or "aborted" (the client went away)."""
    if error is None:
        status, message = 200, None
    elif isinstance(error, str):
        status, message = 499, error
    else:
        status, message = error.status, error.message
    meta = parsed.meta
    recorder.note(gen.arrival, endpoint, body, status, message, gen.usage(),
                  gen.request_metrics(), meta.tenant, meta.priority, meta.cache_salt)


def start(state, path: str | Path, content: str = "body", max_bytes: int | None = None
          ) -> Recorder:
    """Start recording the server's traffic (`state`: its ServerState) into `path`."""
    if state.recorder is not None:
        raise RuntimeError(f"already recording into {state.recorder.path}; stop it first")
    engine = state.engine
    state.recorder = Recorder(path, content=content,
                              max_bytes=max_bytes or state.config.record.max_bytes,
                              tokenizer=engine.tokenizer if engine is not None else None,
                              block_size=state.config.cache.block_size, model=state.model_name)
    return state.recorder


def stop(state) -> dict:
    recorder, state.recorder = state.recorder, None
    if recorder is None:
        raise RuntimeError("not recording")
    return recorder.stop()
