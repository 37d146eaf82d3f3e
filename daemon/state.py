"""The server's typed application state (one `web.AppKey`)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from aiohttp import web

from tokenloom.config.schema import EngineConfig
from tokenloom.daemon.inflight import InFlight
from tokenloom.daemon.metrics import Metrics
from tokenloom.daemon.openai.protocol import Limits
from tokenloom.daemon.sdnotify import Notifier


@dataclasses.dataclass
class ServerState:
    config: EngineConfig
    engine: object | None = None            # tokenloom.actors.engine.Engine once loaded
    engine_task: object | None = None       # the asyncio.Task running the actors
    metrics: Metrics | None = None
    limits: Limits | None = None
    model_name: str = ""
    token_text: Callable[[int], str] | None = None
    ready: bool = False                     # model loaded and warmed up
    draining: bool = False                  # draining (SIGTERM or admin): no new requests
    stopping: bool = False                  # the app is shutting down its engine
    inflight: InFlight = dataclasses.field(default_factory=InFlight)  # HTTP requests running
    drain: object | None = None             # tokenloom.daemon.drain.DrainController (create_app)
    notifier: Notifier = dataclasses.field(default_factory=Notifier)  # sd_notify (or no-op)
    started: int = dataclasses.field(default_factory=lambda: int(time.time()))
    connections: object | None = None       # daemon.connections.ConnectionStats once serving


STATE = web.AppKey("tokenloom_state", ServerState)
