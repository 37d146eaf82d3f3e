"""The server's typed application state (one `web.AppKey`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from tokenloom.actors.engine_client import EngineClient
from tokenloom.config.schema import EngineConfig
from tokenloom.daemon.inflight import InFlight
from tokenloom.daemon.metrics import Metrics
from tokenloom.daemon.openai.protocol import Limits
from tokenloom.daemon.sdnotify import Notifier

if TYPE_CHECKING:   # (both import this module)
    from tokenloom.daemon.connections import ConnectionStats
    from tokenloom.daemon.debug.record import Recorder
    from tokenloom.daemon.drain import DrainController


@dataclasses.dataclass
class ServerState:
    config: EngineConfig
    engine: EngineClient | None = None      # the Engine or the WorkerPool, once loaded
    engine_task: asyncio.Task | None = None  # running the engine's actors
    metrics: Metrics | None = None
    limits: Limits | None = None
    model_name: str = ""
    token_text: Callable[[int], str] | None = None
    ready: bool = False                     # model loaded and warmed up
    draining: bool = False                  # draining (SIGTERM or admin): no new requests
    stopping: bool = False                  # the app is shutting down its engine
    inflight: InFlight = dataclasses.field(default_factory=InFlight)  # HTTP requests running
    drain: DrainController | None = None    # made by create_app
    notifier: Notifier = dataclasses.field(default_factory=Notifier)  # sd_notify (or no-op)
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))
    connections: ConnectionStats | None = None  # once serving
    recorder: Recorder | None = None        # recording traffic (admin record / record.*)
    kv_transfer: Any = None                 # KVTransferService with [kv_transfer] port set
    # The served model's thinking (daemon/openai/reasoning.ModelReasoning), once loaded.
    reasoning: Any = None
    # /v1/responses kept with store=true (daemon/openai/responses_store.ResponseStore).
    responses_store: Any = None
    # server.embeddings: how the model pools (daemon/openai/pooling_config.PoolingConfig).
    pooling: Any = None


STATE = web.AppKey("tokenloom_state", ServerState)
