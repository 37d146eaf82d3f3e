"""KV handoffs between daemons (`[kv_transfer]`): the TCP block server of a prefill daemon
and the pull of a decode daemon, driven by llm-d's prefill/decode protocol.

llm-d's routing sidecar, on a decode pod given `x-prefiller-host-port`, first sends the
request to that prefill pod with `max_tokens: 1`, `stream: false` and
`kv_transfer_params: {"do_remote_decode": true, ...}`; the answer's `kv_transfer_params`
(`remote_block_ids`, `remote_engine_id`, `remote_host`, `remote_port`, as vLLM's
NixlConnector returns them) then go with the original request to the local decode pod.

Prefill side (`export`): the engine ran the request with `RequestMeta.kv_export`, so every
prompt block is in this daemon's handoff tier (actors/kv/tiers/handoff.py; the engine's
`kv_tiers.peer_*` settings point at `dir`). The blocks are put under a lease
(daemon/workers/handoff.py) and named by their chain hashes; the TCP server streams them
to whoever pulls them, then releases the lease; an unclaimed lease expires after
`lease_seconds` and its files are deleted.

Decode side (`pull`): before the request runs, the named blocks are read from the prefill
daemon (frames.py) and written to this daemon's handoff tier, where the engine's restore
planner finds them under the same chain hashes it computes for the prompt (same model,
tokens and cache_salt give the same hashes on both daemons). Whatever did not arrive (a
dead or slow prefill daemon, a corrupt record, another model) is prefilled locally. The
pulled files are released when the request ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
import uuid

import msgspec
import structlog

from tokenloom.actors.kv.tiers.handoff import handoff_file
from tokenloom.config.schema import EngineConfig, KVTransferConfig
from tokenloom.daemon.kv_transfer import frames
from tokenloom.daemon.workers.handoff import HandoffLedger, make_dir

log = structlog.get_logger("tokenloom.kv_transfer")

EXPORT_WAIT_SECONDS = 2.0     # the engine's last blocks may still be on their way to the tier
SWEEP_SECONDS = 0.5


class KVTransferService:
    def __init__(self, cfg: KVTransferConfig, server_host: str):
        self.cfg = cfg
        self.dir = make_dir(cfg.dir, cfg.bytes)
        # The engine writes a prompt's blocks while it prefills, before the HTTP layer can
        # lease them (it learns their hashes at the end): files no lease covers yet are
        # kept for a lease's length from their write.
        self.ledger = HandoffLedger(self.dir, cfg.lease_seconds,
                                    grace_seconds=cfg.lease_seconds)
        self.engine_id = uuid.uuid4().hex
        self.bind_host = cfg.host or server_host
        self.port = cfg.port
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task | None = None
        self.counts = {"exports": 0, "pulls": 0, "pulls_failed": 0, "blocks_pulled": 0,
                       "blocks_missing": 0, "bytes_pulled": 0, "bytes_served": 0,
                       "blocks_served": 0}
        self.pull_seconds = 0.0

    # -- set-up ------------------------------------------------------------------------
    def engine_config(self, config: EngineConfig) -> EngineConfig:
        """The engine's [kv_tiers] with this daemon's handoff tier: written through on a
        prefill (or both) daemon, read only on a decode daemon."""
        if not config.cache.enable_prefix_caching:
            from tokenloom.config.schema import ConfigError
            raise ConfigError("kv_transfer.port needs cache.enable_prefix_caching: handed-off "
                              "blocks are named by the prefix cache's hashes",
                              key="kv_transfer.port")
        t = config.kv_tiers
        base = t if t.enabled else msgspec.structs.replace(t, host_bytes=0, disk_path="",
                                                           remote_url="")
        tiers = msgspec.structs.replace(
            base, enabled=True, peer_path=str(self.dir), peer_bytes=self.cfg.bytes,
            peer_write="off" if self.cfg.role == "decode" else "through")
        return msgspec.structs.replace(config, kv_tiers=tiers)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.bind_host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep(), name="kv-transfer-leases")
        log.info("KV transfer server listening", host=self.bind_host, port=self.port,
                 role=self.cfg.role, dir=str(self.dir), engine_id=self.engine_id)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            for rid in self.ledger.expired():
                self.ledger.close(rid, "expired")
            self.ledger.sweep()

    # -- prefill side --------------------------------------------------------------------
    async def export(self, request_id: str, hashes: list[bytes]) -> dict:
        """Lease the prompt's blocks for a decode daemon; the `kv_transfer_params` naming
        them (only those the tier holds: the decode side recomputes from the first gap)."""
        deadline = time.monotonic() + EXPORT_WAIT_SECONDS
        while True:
            held = [handoff_file(self.dir, h).exists() for h in hashes]
            if all(held) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.002)
        run = held.index(False) if False in held else len(held)
        named = hashes[:run]
        self.ledger.open(None, -1, -1, named, request_id=request_id)
        self.ledger.prefilled(request_id)
        self.counts["exports"] += 1
        return {"do_remote_decode": False, "do_remote_prefill": True,
                "remote_block_ids": [h.hex() for h in named],
                "remote_engine_id": self.engine_id,
                "remote_host": self.cfg.advertise_host or self.bind_host,
                "remote_port": self.port, "remote_request_id": request_id, "tp_size": 1}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            (n,) = frames.LENGTH.unpack(await reader.readexactly(frames.LENGTH.size))
            body = await reader.readexactly(frames.check_length(n, frames.MAX_REQUEST_BYTES))
            req, hashes = frames.decode_request(body)
            mine = req.engine_id == self.engine_id
            if not mine:   # answer "not held" for each block: the decode side prefills
                log.warning("KV pull for another engine id (a restarted prefill daemon?)",
                            wanted=req.engine_id, request_id=req.request_id)
            for h in hashes:
                data = b""
                if mine:
                    with contextlib.suppress(OSError):
                        data = handoff_file(self.dir, h).read_bytes()
                writer.write(frames.LENGTH.pack(len(data)) + data)
                self.counts["bytes_served"] += len(data)
                self.counts["blocks_served"] += bool(data)
                await writer.drain()
            self.ledger.close(req.request_id, "claimed")
        except (asyncio.IncompleteReadError, ConnectionError, frames.FrameError) as e:
            log.warning("KV pull ended early", error=str(e))
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    # -- decode side ---------------------------------------------------------------------
    async def pull(self, request_id: str, params: dict) -> int:
        """Read the blocks `params` names into this daemon's handoff tier, under a lease
        released by `release`. Returns the blocks received; never raises for trouble with
        the peer (the request then prefills locally)."""
        try:
            host, port = str(params["remote_host"]), int(params["remote_port"])
            hashes = [bytes.fromhex(x) for x in params.get("remote_block_ids") or []]
            engine_id = str(params.get("remote_engine_id") or "")
            remote_rid = str(params.get("remote_request_id") or request_id)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("kv_transfer_params unusable; prefilling locally", error=repr(e))
            self.counts["pulls_failed"] += 1
            return 0
        if not hashes:
            return 0
        key = f"pull:{request_id}"
        self.ledger.open(None, -1, -1, hashes, request_id=key)
        self.ledger.decoding(key)
        t0 = time.perf_counter()
        got = 0
        try:
            got = await asyncio.wait_for(self._pull(host, port, remote_rid, engine_id, hashes),
                                         self.cfg.timeout_ms / 1e3)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                frames.FrameError) as e:
            self.counts["pulls_failed"] += 1
            log.warning("KV pull failed; the rest is prefilled locally", host=host, port=port,
                        error=repr(e), request_id=request_id)
        self.counts["pulls"] += 1
        self.pull_seconds += time.perf_counter() - t0
        self.counts["blocks_missing"] += len(hashes) - got
        return got

    async def _pull(self, host: str, port: int, remote_rid: str, engine_id: str,
                    hashes: list[bytes]) -> int:
        reader, writer = await asyncio.open_connection(host, port)
        got = 0
        try:
            writer.write(frames.encode_request(remote_rid, engine_id, hashes))
            await writer.drain()
            for h in hashes:
                (n,) = frames.LENGTH.unpack(await reader.readexactly(frames.LENGTH.size))
                if not n:
                    continue
                data = await reader.readexactly(frames.check_length(n, frames.MAX_RECORD_BYTES))
                await asyncio.to_thread(_write_block, self.dir, h, data)
                got += 1
                self.counts["blocks_pulled"] += 1
                self.counts["bytes_pulled"] += n
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        return got

    def release(self, request_id: str) -> None:
        self.ledger.close(f"pull:{request_id}", "used")

    def stats(self) -> dict:
        return {"role": self.cfg.role, "port": self.port, "engine_id": self.engine_id,
                **self.counts, "pull_seconds": round(self.pull_seconds, 6),
                "leases": self.ledger.stats()}


def _write_block(root, block_hash: bytes, data: bytes) -> None:
    """Atomically (temp file + rename): the engine reads a whole record or none."""
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, handoff_file(root, block_hash))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
