"""The aiohttp application: routes, the error/logging middleware, and the engine's lifetime.

The engine's actors are started and stopped by a `cleanup_ctx`: the model is loaded (in a
worker thread, so signals are still handled), the actors start, one warm-up request runs,
then the server is ready; on cleanup the actors are shut down and awaited.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog
from aiohttp import web

from tokenloom.config.schema import EngineConfig
from tokenloom.daemon import logs
from tokenloom.daemon.admin import server as admin_server
from tokenloom.daemon.drain import DrainController
from tokenloom.daemon.errors import APIError
from tokenloom.daemon.metrics import CONTENT_TYPE, Metrics
from tokenloom.daemon.openai import embeddings, endpoints, messages_api, render, responses_api
from tokenloom.daemon.openai.chat import chat_completions
from tokenloom.daemon.openai.completions import completions
from tokenloom.daemon.openai.protocol import Limits
from tokenloom.daemon.openai.responses import HealthResponse, ReadyResponse
from tokenloom.daemon.sdnotify import Notifier
from tokenloom.daemon.state import STATE, ServerState
from tokenloom.startup_log import startup_log

log = structlog.get_logger("tokenloom.http")


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every error leaves as an OpenAI-style JSON body; one log line per HTTP request."""
    structlog.contextvars.clear_contextvars()
    t0 = time.monotonic()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except APIError as e:
        status = e.status
        if e.status >= 500:
            log.error("request failed", status=e.status, error=e.message)
        else:
            log.info("request refused", status=e.status, error=e.message, param=e.param)
        return _error_response(request, e)
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        reason = {404: f"no route for {request.method} {request.path}",
                  405: f"method {request.method} is not allowed on {request.path}"}
        return _error_response(request, APIError(
            e.status, reason.get(e.status, e.reason),
            headers={k: v for k, v in e.headers.items() if k.lower() == "allow"}))
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away (nginx's convention)
        raise
    except Exception as e:  # a bug: end this request only
        log.exception("unhandled error", error=repr(e))
        return APIError(500, f"internal error: {e!r}").response()
    finally:
        state = request.app[STATE]
        if state.metrics is not None and request.match_info.route.resource is not None:
            endpoint = request.match_info.route.resource.canonical
            state.metrics.http.labels(endpoint, str(status)).inc()
        if request.path not in ("/health", "/metrics"):
            log.info("http", method=request.method, path=request.path, status=status,
                     seconds=round(time.monotonic() - t0, 6))
        structlog.contextvars.clear_contextvars()


def _error_response(request: web.Request, e: APIError) -> web.Response:
    """An error in the shape of the API the path belongs to: Anthropic's for the Messages
    API, OpenAI's everywhere else."""
    if request.path.startswith("/v1/messages"):
        return messages_api.error_response(e)
    return e.response()


def engine_problem(state: ServerState) -> str | None:
    """Why the engine is not healthy, or None. Read without any actor's inbox, so it answers
    even when the scheduler is stuck waiting for a wedged runner. /health and the systemd
    watchdog pings share it."""
    task = state.engine_task
    if task is not None and task.done():
        return "the engine has stopped"
    if state.engine is not None and task is not None:
        stalled = state.engine.stalled_seconds()
        limit = state.config.server.health_stall_seconds
        if stalled > limit:
            return (f"the engine has completed no step for {stalled:.1f} s with work queued "
                    f"(server.health_stall_seconds = {limit:g})")
    return None


async def health(request: web.Request) -> web.Response:
    """Liveness: the event loop answers, the engine's actors are alive, and the engine loop
    makes progress while it has work. With worker processes the body lists each worker
    (up, pid, restarts, last exit status): "degraded" while one is down and restarting,
    503 only when none is up."""
    state = request.app[STATE]
    problem = engine_problem(state)
    if problem is not None:
        raise APIError(503, problem)
    status = state.engine.worker_status() if state.engine is not None else []
    if not status:   # the in-process engine
        probe = getattr(state.engine, "degraded_tiers", None)
        tiers = probe() if probe is not None else {}
        if tiers:    # alive, but a KV tier falls back to recompute until it recovers
            return endpoints.struct_response(HealthResponse(status="degraded", workers=[],
                                                            kv_tiers=tiers))
        return web.Response(status=200)
    up = sum(w.up for w in status)
    if state.ready and up == 0:
        raise APIError(503, f"no engine worker is up (0/{len(status)}; restarting)")
    probe = getattr(state.engine, "handoff_status", None)
    return endpoints.struct_response(HealthResponse(
        status="ok" if up == len(status) else "degraded", workers=status,
        handoffs=probe() if probe is not None else None))


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        raise APIError(503, "draining")
    if not state.ready:
        raise APIError(503, "loading")
    status = state.engine.worker_status()
    if not status:   # the in-process engine
        return endpoints.struct_response(ReadyResponse(status="ready"))
    up, total = sum(w.up for w in status), len(status)
    if up == 0:
        raise APIError(503, f"no engine worker is up (0/{total})")
    roles = {w.role for w in status}
    if roles != {"both"}:   # disaggregation: ready only with a worker of each role up
        roles_up = {r: sum(w.up for w in status if w.role == r) for r in sorted(roles)}
        if not roles_up.get("decode"):
            raise APIError(503, "no decode worker is up")
        return endpoints.struct_response(ReadyResponse(status="ready", workers_up=up,
                                                       workers=total, roles_up=roles_up))
    return endpoints.struct_response(ReadyResponse(status="ready", workers_up=up, workers=total))


async def openapi_json(request: web.Request) -> web.Response:
    """The OpenAPI 3.1 document, with this server's bounds (daemon/openai/openapi.py)."""
    from tokenloom.daemon.openai.openapi import document

    state = request.app[STATE]
    limits = state.limits
    cap = limits.max_model_len if limits is not None else None
    if state.config.server.max_tokens:
        cap = min(cap or state.config.server.max_tokens, state.config.server.max_tokens)
    return web.json_response(document(limits, max_tokens=cap,
                                      max_logprobs=state.config.server.max_logprobs,
                                      lora_updates=state.config.lora.allow_runtime_updates,
                                      embeddings=state.config.server.embeddings))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None and state.ready:
        await state.metrics.refresh(state.engine)
    return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def served_model_name(config: EngineConfig, engine) -> str:
    return config.server.served_model_name or Path(engine.info.model_dir).name


async def warm_up(engine) -> None:
    """One request through every actor with a prefill and a decode step (two tokens, EOS
    ignored), before ready: first-call costs are paid, and a decode step that fails stops
    start-up with its error instead of failing every request behind a 200 /ready."""
    from tokenloom.actors.messages import GenerateRequest
    from tokenloom.actors.sampling_params import SamplingParams

    first = engine.tokenizer.bos_token_id
    req = GenerateRequest(request_id="warmup-0", prompt_token_ids=[first if first is not None
                                                                   else 0],
                          sampling_params=SamplingParams(max_tokens=2, temperature=0.0,
                                                         ignore_eos=True))
    async for out in engine.generate(req):
        if out.finished and out.finish_reason == "error":
            raise RuntimeError(f"warm-up failed: {out.error}")


async def _start_engine(state: ServerState):
    """Load the engine (unless one was given), start its actors and warm it up."""
    if state.engine is None:
        from tokenloom.actors.engine import Engine

        model = state.config.model.model
        startup_log.info(f"loading model {model}", model=model)
        config = state.config
        if config.kv_transfer.port:   # llm-d P/D handoffs between daemons
            from tokenloom.daemon.kv_transfer.service import KVTransferService
            if config.workers.count > 1:
                from tokenloom.config.schema import ConfigError
                raise ConfigError("kv_transfer.port needs workers.count = 1 (one engine per "
                                  "daemon, as llm-d deploys prefill and decode pods)",
                                  key="kv_transfer.port")
            state.kv_transfer = KVTransferService(config.kv_transfer, config.server.host)
            config = state.kv_transfer.engine_config(config)
        if config.workers.count > 1:   # worker processes (daemon/workers/)
            from tokenloom.daemon.workers.pool import WorkerPool
            state.engine = await WorkerPool.start(config)
        else:
            loop = asyncio.get_running_loop()
            state.engine = await loop.run_in_executor(None, Engine.build, config)
        if state.kv_transfer is not None:
            await state.kv_transfer.start()
    engine = state.engine
    state.engine_task = asyncio.create_task(engine.run(), name="engine")
    state.engine_task.add_done_callback(lambda task: _engine_stopped(state, task))
    state.model_name = served_model_name(state.config, engine)
    state.limits = Limits(max_n=state.config.server.max_n, served_name=state.model_name,
                          model_names=frozenset({state.model_name, state.config.model.model}),
                          max_model_len=engine.info.max_model_len,
                          max_tokens=state.config.server.max_tokens,
                          max_logprobs=state.config.server.max_logprobs,
                          lora_adapters=getattr(engine, "lora_adapters", None),
                          speculation=state.config.speculative.method != "off")
    state.metrics = Metrics(state.model_name, engine.info.max_model_len)
    state.token_text = endpoints.token_text_cache(engine.tokenizer)
    from tokenloom.daemon.openai.reasoning import ModelReasoning, for_model
    parser = for_model(state.config.server.reasoning_parser,
                       getattr(engine.tokenizer, "chat_template", None),
                       engine.info.spec.architecture)
    state.reasoning = ModelReasoning(parser, engine.tokenizer)
    if parser is not None:
        startup_log.info(f"reasoning parser: {parser.name} ({parser.start} ... {parser.end})",
                         reasoning_parser=parser.name)
    if state.config.server.embeddings:
        from tokenloom.config.schema import ConfigError
        from tokenloom.daemon.openai import pooling_config
        try:
            state.pooling = pooling_config.load(engine.info.model_dir,
                                                engine.info.spec.hidden_size)
        except pooling_config.PoolingConfigError as e:
            raise ConfigError(f"server.embeddings: {e}", key="server.embeddings") from None
        startup_log.info(f"embeddings: {state.pooling.kind} pooling"
                         + (", normalized" if state.pooling.normalize else ""),
                         pooling=state.pooling.kind)
    startup_log.info("warming up")
    await warm_up(engine)
    return engine


def _engine_stopped(state: ServerState, task: asyncio.Task) -> None:
    """The actors' TaskGroup ended. Unless we are shutting down that is a crash: requests
    waiting on their streams would wait forever, so end them with an error; /health and
    /ready turn 503."""
    if state.stopping or not state.ready:
        return
    state.ready = False
    error = None if task.cancelled() else task.exception()
    log.error("engine stopped unexpectedly", error=repr(error))
    from tokenloom.actors.messages import ERROR_INTERNAL
    state.engine.streams.fail_all(f"the engine stopped: {error!r}", ERROR_INTERNAL)


async def engine_ctx(app: web.Application):
    """cleanup_ctx: load (unless an engine was given), start actors, warm up; then stop.
    Start-up events are systemd STATUS= lines too."""
    state = app[STATE]
    with logs.startup_sink(state.notifier.status):
        engine = await _start_engine(state)
    state.ready = True
    log.info("ready", model=state.model_name, max_model_len=engine.info.max_model_len,
             kv_blocks=engine.info.num_blocks)
    if state.config.record.enabled:
        from tokenloom.daemon.debug import record
        rc = state.config.record
        record.start(state, rc.path, rc.content, rc.max_bytes)
        log.info("recording traffic", path=rc.path, content=rc.content)
    try:
        yield
    finally:
        if state.recorder is not None:
            from tokenloom.daemon.debug import record
            log.info("recording stopped", **record.stop(state))
        state.ready = False
        state.draining = state.stopping = True
        if state.kv_transfer is not None:
            await state.kv_transfer.close()
        engine.shutdown()
        task = state.engine_task
        done, _ = await asyncio.wait({task}, timeout=30)  # never raises the task's error
        if not done:
            log.error("engine did not stop within 30 s; cancelling it")
            task.cancel()
        elif not task.cancelled() and task.exception() is not None:
            log.error("engine stopped with an error", error=repr(task.exception()))


def create_app(config: EngineConfig, engine=None, notifier: Notifier | None = None
               ) -> web.Application:
    """The application. `engine`: an already built (not yet running) Engine, e.g. in tests;
    None builds one from `config` at start-up. `notifier`: systemd notifications (STATUS=
    during start-up and drain); None sends none."""
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=config.server.max_body_bytes)
    state = ServerState(config=config, engine=engine,
                        metrics=Metrics(config.server.served_model_name or "loading"),
                        notifier=notifier or Notifier())
    state.drain = DrainController(state)
    from tokenloom.daemon.openai.responses_store import ResponseStore
    state.responses_store = ResponseStore(config.server.responses_store_size,
                                          config.server.responses_store_ttl_seconds)
    app[STATE] = state
    app.cleanup_ctx.append(engine_ctx)
    app.cleanup_ctx.append(admin_server.admin_ctx)  # after the engine is up; closed first
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions/render", render.render_completion)
    app.router.add_post("/v1/chat/completions/render", render.render_chat)
    # The agent APIs: OpenAI Responses (Codex CLI) and Anthropic Messages (Claude Code).
    app.router.add_post("/v1/responses", responses_api.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses_api.get_response)
    app.router.add_post("/v1/responses/render", responses_api.render_response)
    app.router.add_post("/v1/messages", messages_api.create_message)
    app.router.add_post("/v1/messages/count_tokens", messages_api.count_tokens)
    app.router.add_post("/v1/messages/render", messages_api.render_message)
    if config.server.embeddings:   # as vLLM and llama-server: only when asked for
        app.router.add_post("/v1/embeddings", embeddings.embeddings)
    app.router.add_get("/v1/models", endpoints.models)
    if config.lora.allow_runtime_updates:   # vLLM: 404 unless runtime updates are allowed
        app.router.add_post("/v1/load_lora_adapter", endpoints.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", endpoints.unload_lora_adapter)
    app.router.add_get("/v1/requests/{request_id}/trace", endpoints.request_trace)
    app.router.add_post("/tokenize", endpoints.tokenize)
    app.router.add_post("/detokenize", endpoints.detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi_json)
    return app


async def start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Run `app` on host:port (0: any free port); returns the runner and the bound port.

    handler_cancellation: a client that disconnects cancels its handler, which aborts its
    engine requests (streaming or not) so their KV blocks are freed within one iteration.
    """
    from tokenloom.daemon.connections import ConnectionStats, GuardedTCPSite

    server = app[STATE].config.server
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0,
                           keepalive_timeout=server.keepalive_timeout_seconds)
    await runner.setup()
    stats = ConnectionStats(max_connections=server.max_connections,
                            header_timeout=server.header_timeout_seconds)
    app[STATE].connections = stats
    site = GuardedTCPSite(runner, host, port, stats)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1] if port == 0 else port
    return runner, bound
