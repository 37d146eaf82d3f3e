"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

It drives the same actors as the daemon (there is no second engine loop): the engine runs
on an event loop in a background thread; `generate` submits requests to it and waits.

Logging is structlog's. Where the application has not configured it, the first LLM does:
warnings and up to stderr, and start-up progress (the "tokenloom.startup" logger: model
loaded, KV cache size...) unless the LLM is built with `quiet=True`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import logging
import queue
import sys
import threading
from typing import Any, Iterator, Sequence

import msgspec
import structlog

from tokenloom.actors.engine import Engine
from tokenloom.actors.front.fan_out import fan_out
from tokenloom.actors.kv.prefix_cache import FlushResult
from tokenloom.actors.messages import (
    CheckIntegrity,
    FlushPrefixCache,
    GenerateRequest,
    GetGraphStats,
    GetKVStats,
    GetSchedulerStats,
    GetTrace,
    GraphStats,
    IsIdle,
    KVStats,
    RequestMeta,
    RequestOutput,
    SchedulerStats,
    SubscribeKVEvents,
    TokenLogprob,
)
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.config.load import load_config
from tokenloom.config.schema import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    GraphsConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    field_types,
)
from tokenloom.startup_log import STARTUP_LOGGER

_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "graphs": GraphsConfig, "speculative": SpeculativeConfig, "lora": LoRAConfig}
# Per thread of control, so that a quiet LLM built beside a chatty one stays quiet.
_show_startup: contextvars.ContextVar[bool] = contextvars.ContextVar("tokenloom_show_startup",
                                                                     default=True)


def _library_filter(logger, method_name: str, event_dict):
    """A library must not spray debug lines: warnings and up, plus start-up progress unless
    the LLM being built is quiet."""
    level = structlog.processors.NAME_TO_LEVEL.get(method_name, logging.CRITICAL)
    if level >= logging.WARNING or (level >= logging.INFO and _show_startup.get()
                                    and event_dict.get("logger_name") == STARTUP_LOGGER):
        return event_dict
    raise structlog.DropEvent


def _configure_logging_once() -> None:
    """structlog's default console output, on stderr and filtered, unless the application
    configured structlog itself (then its configuration decides what is shown)."""
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[_library_filter, *structlog.get_config()["processors"]],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr))


@dataclasses.dataclass
class Timings:
    """Seconds since the request arrived."""
    queued: float | None          # until first scheduled
    first_token: float | None     # time to first token
    token_times: list[float]      # one per generated token
    e2e: float | None
    num_preemptions: int
    num_cached_tokens: int = 0          # prompt tokens whose KV came from the prefix cache
    prefix_hit_blocks: int = 0
    prefix_miss_reason: str | None = None  # why the first uncached block missed
    cached_tokens_by_tier: dict[str, int] | None = None  # [kv_tiers] on: where they came from


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    timings: Timings | None
    error: str | None = None


@dataclasses.dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    num_prompt_tokens: int
    outputs: list[CompletionOutput]
    # SamplingParams.prompt_logprobs (vLLM's shape): per prompt token, {token id: logprob}
    # for the token itself and the top-k at that position; the first entry is None.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def options_to_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """`LLM(max_num_seqs=8, block_size=32)` ->
    {"scheduler.max_num_seqs": 8, "cache.block_size": 32}."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        if "." in key:
            out[key] = value
            continue
        owners = [name for name, cls in _SECTIONS.items() if key in field_types(cls)]
        if not owners:
            allowed = sorted({f for cls in _SECTIONS.values() for f in field_types(cls)})
            raise ConfigError(f"unknown option {key!r} (allowed: {', '.join(allowed)})", key)
        out[f"{owners[0]}.{key}"] = value
    return out


class LLM:
    def __init__(self, model: str = "default", *, config: EngineConfig | None = None,
                 config_path: str | None = None, quiet: bool = False, **options: Any):
        """`quiet`: do not show start-up progress (see the module docstring)."""
        if config is None:
            overrides = options_to_overrides({"model": model, **options})
            config = load_config(config_path, overrides=overrides)
        _configure_logging_once()
        shown = _show_startup.set(not quiet)
        try:
            self.engine = Engine.build(config)
        finally:
            _show_startup.reset(shown)
        self.tokenizer = self.engine.tokenizer
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenloom-engine",
                                        daemon=True)
        self._thread.start()
        self._engine_run = asyncio.run_coroutine_threadsafe(self.engine.run(), self._loop)

    # -- public API ----------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[GenerationOutput]:
        """`cache_salt` isolates prefix-cache reuse: requests with different salts never
        share KV blocks (e.g. one salt per tenant). `lora`: the LoRA adapter to run with
        (a name from lora.modules or load_lora_adapter), one for all prompts or one per
        prompt (None: the base model)."""
        items = _normalise_prompts(prompts)
        params = _per_prompt(sampling_params, len(items))
        adapters = [lora] * len(items) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(items):
            raise ValueError(f"lora: {len(adapters)} adapters for {len(items)} prompts")
        known = self.engine.lora_adapters
        for name in adapters:
            if name is not None and (known is None or name not in known):
                raise ValueError(f"lora: the adapter {name!r} is not loaded (loaded: "
                                 f"{', '.join(sorted(known or {})) or 'none'})")
        return self._wait(self._generate_all(
            [(p, sp, None, a) for p, sp, a in zip(items, params, adapters)], cache_salt))

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (needs lora.enable)."""
        self._wait(self.engine.load_lora_adapter(name, path))

    def unload_lora_adapter(self, name: str) -> bool:
        return self._wait(self.engine.unload_lora_adapter(name))

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[GenerationOutput]:
        single = conversations and isinstance(conversations[0], dict)
        convs = [conversations] if single else conversations
        params = _per_prompt(sampling_params, len(convs))
        return self._wait(self._generate_all([(None, sp, c, None)
                                              for c, sp in zip(convs, params)]))

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
               messages: list[dict] | None = None) -> Iterator[str]:
        """Yield text deltas of one completion as they are generated."""
        params = sampling_params or SamplingParams()
        q: queue.Queue[str | None] = queue.Queue()  # engine thread -> caller thread

        async def produce():
            try:
                (request,) = fan_out(self.engine.new_request_id(), [prompt],
                                     msgspec.structs.replace(params, n=1), messages=messages)
                await self._choice(request, on_delta=q.put)
            finally:
                q.put(None)

        fut = asyncio.run_coroutine_threadsafe(produce(), self._loop)
        while True:
            item = q.get()
            if item is None:
                break
            yield item
        fut.result()

    def ask(self, actor, query) -> Any:
        """Send a typed query (messages.py, "control") to one of the engine's actors."""
        return self._wait(self.engine.ask(actor, query))

    def trace(self, request_id: str) -> list[dict]:
        """The trace of a recent request (one per choice when n > 1), as served by
        `GET /v1/requests/{id}/trace`; [] once it has left the trace history."""
        return self.ask(self.engine.scheduler, GetTrace(request_id=request_id))

    def check_integrity(self) -> None:
        """KV pool integrity (free + used == total, no block owned twice) — raises if broken."""
        problem = self.ask(self.engine.kv_manager, CheckIntegrity())
        if problem is not None:
            raise AssertionError(problem)

    def wait_for_idle(self, timeout: float = 10.0) -> KVStats:
        """Block until no request is queued, running or in flight and every block is back
        in the pool (frees land with the scheduler's next KV update, after the final output).
        Returns the KV stats; raises TimeoutError if that does not happen in `timeout`."""
        import time
        deadline = time.monotonic() + timeout
        while True:
            stats = self.kv_stats()
            if stats.used == 0 and self.ask(self.engine.scheduler, IsIdle()):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine not idle after {timeout}s: {stats}")
            time.sleep(0.01)

    def flush_cache(self, force: bool = False) -> FlushResult:
        """Drop every unreferenced cached block: FlushResult(freed, refused_reason).
        Refuses (freed 0, with a reason) while requests hold blocks, unless `force`."""
        return self.ask(self.engine.kv_manager, FlushPrefixCache(force=force))

    def subscribe_kv_events(self, callback) -> None:
        """Call `callback(event)` for every BlockStored / BlockRemoved / AllBlocksCleared
        (vLLM-shaped, see actors/kv/events.py), in order, on the engine's event loop."""
        self.ask(self.engine.kv_manager, SubscribeKVEvents(callback=callback))

    def kv_stats(self) -> KVStats:
        return self.ask(self.engine.kv_manager, GetKVStats())

    def scheduler_stats(self) -> SchedulerStats:
        return self.ask(self.engine.scheduler, GetSchedulerStats())

    def graph_stats(self) -> GraphStats:
        """How steps ran (graphs/dispatch.py): decode graph, piecewise and eager steps (eager
        with reasons), replays counted where they happen, padding waste, the decode
        batch-size histogram (what graphs.histogram_path reads), capture time and memory.
        Asked of the runner actor, in order after the steps it has run."""
        return self.ask(self.engine.runner, GetGraphStats())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self.engine.shutdown)
        try:
            self._engine_run.result(timeout=30)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------
    def _wait(self, coro):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        done, _ = concurrent.futures.wait([fut, self._engine_run],
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if fut not in done:
            fut.cancel()
            self._engine_run.result()  # re-raises the engine's failure
            raise RuntimeError("engine stopped")
        return fut.result()

    async def _generate_all(self, items, cache_salt: str | None = None) -> list[GenerationOutput]:
        tasks = []
        for prompt, params, messages, lora in items:
            rid = self.engine.new_request_id()
            tasks.append(self._prompt(prompt, params, messages, rid, cache_salt, lora))
        return list(await asyncio.gather(*tasks))

    async def _prompt(self, prompt, params: SamplingParams, messages, rid: str,
                      cache_salt: str | None = None,
                      lora: str | None = None) -> GenerationOutput:
        requests = fan_out(rid, [prompt], params, RequestMeta(cache_salt=cache_salt, lora=lora),
                           messages=messages)
        prompt_out: list[RequestOutput] = []   # the output that carries the prompt's logprobs
        results = await asyncio.gather(*(self._choice(r, i, prompt_out=prompt_out)
                                         for i, r in enumerate(requests)))
        ids = list(prompt) if isinstance(prompt, list) else None
        if prompt_out and prompt_out[0].prompt_token_ids is not None:
            ids = prompt_out[0].prompt_token_ids
        return GenerationOutput(request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
                                prompt_token_ids=ids, num_prompt_tokens=results[0][1],
                                outputs=[out for out, _ in results],
                                prompt_logprobs=_prompt_logprobs(prompt_out))

    async def _choice(self, request: GenerateRequest, index: int = 0, on_delta=None,
                      prompt_out: list | None = None) -> tuple[CompletionOutput, int]:
        """Run one engine request; its outputs come detokenized, stop strings applied.
        `prompt_out`: gets the output that carries the prompt logprobs, if one does."""
        text: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] | None = ([] if request.sampling_params.logprobs is not None
                                               else None)
        last: RequestOutput | None = None
        num_prompt = 0
        async for out in self.engine.generate(request):
            last = out
            num_prompt = out.num_prompt_tokens or num_prompt
            if out.prompt_logprobs is not None and prompt_out is not None and not prompt_out:
                prompt_out.append(out)
            token_ids.extend(out.new_token_ids)
            if logprobs is not None and out.new_logprobs:
                logprobs.extend(out.new_logprobs)
            if out.text:
                text.append(out.text)
                if on_delta is not None:
                    on_delta(out.text)
        timings = _timings(last.timings) if last is not None and last.timings else None
        return CompletionOutput(index=index, text="".join(text), token_ids=token_ids,
                                finish_reason=last.finish_reason if last is not None else None,
                                logprobs=logprobs, timings=timings,
                                error=last.error if last is not None else None), num_prompt


def _prompt_logprobs(outs: list[RequestOutput]) -> list[dict[int, float] | None] | None:
    if not outs:
        return None
    return [None if lp is None else {lp.token_id: lp.logprob, **dict(lp.top or ())}
            for lp in outs[0].prompt_logprobs]


def _timings(t) -> Timings:
    rel = lambda x: None if x is None else x - t.arrival  # noqa: E731
    return Timings(queued=rel(t.first_scheduled), first_token=rel(t.first_token),
                   token_times=[x - t.arrival for x in t.token_times], e2e=rel(t.finished),
                   num_preemptions=t.num_preemptions, num_cached_tokens=t.num_cached_tokens,
                   prefix_hit_blocks=t.prefix_hit_blocks, prefix_miss_reason=t.prefix_miss_reason,
                   cached_tokens_by_tier=t.cached_tokens_by_tier)


def _normalise_prompts(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return [list(p) if not isinstance(p, str) else p for p in prompts]


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
