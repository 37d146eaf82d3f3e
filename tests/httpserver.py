"""A tokenloom HTTP server on 127.0.0.1 (a free port) in a background thread, for tests.

The server runs the real app (`create_app` + `AppRunner`/`TCPSite`) on its own uvloop event
loop, so tests talk to it over real sockets with any client, and can still query the engine's
actors with typed queries (`server.ask("kv_manager", GetKVStats())`).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from tokenloom.config.load import load_config


def tiny_config(model_dir: Path, cache_dir: Path, **overrides):
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
        self.runner, self.port = self.call(self._start())
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
