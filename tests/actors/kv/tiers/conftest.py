"""Fixtures for the KV tier tests: a tiny layout, records and chains of them, and a real
``redis-server`` process (no fakes: the remote tier is tested against the real protocol)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from tokenloom.actors.kv.tiers.record import BlockMeta, BlockRecord, KVLayout

# 2 layers x K/V x 4 tokens x 1 head x 8 dims of float32: 512 bytes a block.
LAYOUT = KVLayout("float32", (2, 2, 4, 1, 8), 4)


@pytest.fixture
def layout() -> KVLayout:
    return LAYOUT


@pytest.fixture
def make_record() -> Callable[..., BlockRecord]:
    """``make_record(parent=None)``: a block with a random hash and payload."""
    rng = np.random.default_rng(0)

    def make(parent: bytes | None = None, layout: KVLayout = LAYOUT) -> BlockRecord:
        h = rng.bytes(32)
        tokens = tuple(int(t) for t in rng.integers(0, 50_000, 4))
        payload = rng.integers(0, 256, layout.block_bytes, dtype=np.uint8)
        return BlockRecord(BlockMeta(h, parent, tokens, "salt" if parent is None else None),
                           payload)

    return make


@pytest.fixture
def make_chain(make_record) -> Callable[[int], list[BlockRecord]]:
    """``make_chain(n)``: n blocks, each the parent of the next."""
    def make(n: int) -> list[BlockRecord]:
        out: list[BlockRecord] = []
        for _ in range(n):
            out.append(make_record(out[-1].meta.block_hash if out else None))
        return out

    return make


def same(a: BlockRecord | None, b: BlockRecord) -> bool:
    return a is not None and a.meta == b.meta and bytes(a.payload) == bytes(b.payload)


@pytest.fixture
def same_record() -> Callable[[BlockRecord | None, BlockRecord], bool]:
    return same


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` on 127.0.0.1:``port``, in memory only."""

    def __init__(self, exe: str, workdir: Path) -> None:
        self.exe, self.workdir = exe, workdir
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self._clients: list[redis.Redis] = []
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=0.2, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """Kill (if running) and start again on the same port, empty."""
        self.kill()
        self.start()

    def client(self) -> redis.Redis:
        """A plain client, to look at or tamper with what the store wrote."""
        self._clients.append(redis.Redis(port=self.port))
        return self._clients[-1]

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.kill()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not on PATH; `make test` installs it "
                    "(or: apt-get install redis-server)")
    server = RedisServer(exe, tmp_path)
    try:
        yield server
    finally:
        server.close()
