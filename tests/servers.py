"""The two ways tests run a tokenloom HTTP server on 127.0.0.1 (a free port, port 0):

- `ServerThread(config)`: the real app (`create_app` + `AppRunner`/`TCPSite`) on its own
  uvloop event loop in a background thread of the test process. Tests talk to it over real
  sockets with any client and can still query the engine's actors with typed queries
  (`server.ask("kv_manager", GetKVStats())`). `tiny_config` is the config the daemon tests
  give it.
- `ServerProcess(*args)`: `tokenloom serve` as a real subprocess (or another command line
  that ends in `serve`, e.g. the installed wheel's or one with a test hook). Its JSON log
  line {"event": "listening", "port": N} tells the port; every stderr line is kept (`lines`)
  for log assertions.

What talks to them is tests/client.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

TOKENLOOM = str(Path(sys.executable).with_name("tokenloom"))


def tiny_config(model_dir: Path, cache_dir: Path, **overrides):
    from tokenloom.config.load import load_config

    base = {"model.model": str(model_dir), "model.device": "cpu", "model.dtype": "float32",
            "model.cache_dir": str(cache_dir), "cache.block_size": 8, "cache.num_blocks": 1024,
            "scheduler.max_num_seqs": 64, "scheduler.max_num_batched_tokens": 512}
    base.update(overrides)
    return load_config(overrides=base, env=None)
class ServerThread:
    def __init__(self, config, engine=None):
        import uvloop

        from tokenloom.actors.engine import Engine
        from tokenloom.daemon.app import create_app

        self.engine = engine or Engine.build(config)
        self.app = create_app(config, self.engine)
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server",
                                        daemon=True)
        self._thread.start()
        # Start-up warms the engine up (the first engine of a session builds the C++ CPU
        # kernels, ~30 s): generous, since a loaded machine can take several times that.
        self.runner, self.port = self.call(self._start(), timeout=300)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self):
        from tokenloom.daemon.app import start
        return await start(self.app, "127.0.0.1", 0)

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def ask(self, actor: str, query):
        """A typed query (tokenloom.actors.messages, "control") to the named actor."""
        return self.call(self.engine.ask(getattr(self.engine, actor), query))

    def stats(self):
        return self.call(self.engine.stats())

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until the scheduler is idle and every block is back; return the KV and
        scheduler stats as one dict, plus the open streams."""
        import msgspec

        from tokenloom.actors.messages import IsIdle

        async def idle():
            deadline = self.loop.time() + timeout
            while True:
                s = await self.engine.stats()
                if (s.kv.used == 0 and await self.engine.ask(self.engine.scheduler, IsIdle())) \
                        or self.loop.time() > deadline:
                    return {**msgspec.to_builtins(s.kv), **msgspec.to_builtins(s.scheduler),
                            "streams": len(self.engine.streams)}
                await asyncio.sleep(0.02)
        return self.call(idle(), timeout + 5)

    def close(self) -> None:
        try:
            self.call(self.runner.cleanup(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 120.0, env: dict | None = None,
                 command: tuple[str, ...] = (TOKENLOOM,), cwd: str | None = None):
        """`*command serve --host 127.0.0.1 --port 0 *args`, started and waited for until it
        listens. `env` is added to this process's environment; an entry set to None unsets
        that variable."""
        cmd = [*command, "serve", "--host", "127.0.0.1", "--port", "0", *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        full_env = {k: v for k, v in full_env.items() if v is not None}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=full_env, text=True, cwd=cwd)
        self.lines: list[str] = []
        self._port: int | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self._port is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self._port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self._port is None:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "listening":
                    self._port = event["port"]
                    self._ready.set()
        self._ready.set()  # exited before listening

    def json_lines(self) -> list[dict]:
        """Log lines (JSON objects); anything else on stderr (library warnings) is skipped."""
        out = []
        for line in self.lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
