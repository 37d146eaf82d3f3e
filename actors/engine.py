"""Assemble the engine: load the model, size the KV pool, wire the actors, run them.

Start-up order: model and tokenizer (slow, synchronous) -> KV pool sized from the memory
budget -> actors wired inbox to inbox -> `run()` starts every actor loop in one TaskGroup.
`generate()` is the one way in, for the offline API and the HTTP daemon alike.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog
import torch

from tokenloom.actors.engine_client import EngineFront, merge_traces
from tokenloom.actors.execution.compute_thread import ComputeThread
from tokenloom.actors.execution.guided import GuidedCompiler
from tokenloom.actors.execution.lora_cache import LoRACache
from tokenloom.actors.execution.model_runner import ModelRunner
from tokenloom.actors.execution.runner_actor import RunnerActor
from tokenloom.actors.front.router_actor import RouterActor
from tokenloom.actors.front.tokenizer_actor import TokenizerActor
from tokenloom.actors.kv.block_hash import long_rope_window, model_fingerprint
from tokenloom.actors.kv.groups import KVGroups
from tokenloom.actors.kv.kv_actor import KVManagerActor
from tokenloom.actors.kv.kv_manager import KVCacheManager
from tokenloom.actors.kv.tiers.record import KVLayout
from tokenloom.actors.kv.tiers.setup import build_tiers
from tokenloom.actors.messages import (
    EngineStats,
    FlushPrefixCache,
    GetKVStats,
    GetRouterStats,
    GetSchedulerStats,
    GetTrace,
    RequestFinished,
    RequestOutput,
    RuntimeInfo,
    SetLoRAAdapter,
    Shutdown,
    WorkerStats,
    WorkerStatus,
)
from tokenloom.actors.output.output_processor import OutputProcessor
from tokenloom.actors.scheduling.lora_slots import AdapterSlots
from tokenloom.actors.scheduling.policy import PolicyLimits
from tokenloom.actors.scheduling.prefix_tracker import PrefixTracker
from tokenloom.actors.scheduling.scheduler import Scheduler
from tokenloom.actors.scheduling.scheduler_actor import SchedulerActor
from tokenloom.actors.scheduling.swap import SwapSpace
from tokenloom.actors.speculation.controller import SpecController
from tokenloom.actors.speculation.proposers import NgramProposer
from tokenloom.arith import cdiv
from tokenloom.config.schema import ConfigError, EngineConfig, resolve_cache_dir
from tokenloom.kernels.device import pick_device, pick_dtype, select_decode_backend
from tokenloom.kernels.kv_quality_check import KVQualityCheck, auto_budgets
from tokenloom.kernels.kv_quant import (
    hadamard,
    kv_dtype_name,
    kv_format,
    kv_storage_dtype,
    quantized_bytes_per_block,
    resolve_rotation,
)
from tokenloom.kernels.kv_store import HostKVPool, KVCache
from tokenloom.kernels.lora.peft_adapter import LoRAAdapterError, load_adapter
from tokenloom.kernels.lora.stacks import LoRAStacks
from tokenloom.kernels.models.kv_quality_gate import apply_kv_gate
from tokenloom.kernels.models.loader import load_model, load_spec, resolve_model_dir, weights_digest
from tokenloom.kernels.models.model_spec import ModelSpec
from tokenloom.kernels.models.weights import apply_weight_dtype
from tokenloom.startup_log import startup_log

log = structlog.get_logger("tokenloom.engine")


def kv_block_bytes(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                   layers: int | None = None) -> tuple[int, int]:
    """(bytes a block takes from the budget, bytes per token of the block itself). A
    block holds `layers` layers (a layer group's, actors/kv/groups.py; default: every
    layer). A quantized pool's blocks are 1-byte values plus scales; the runtime check's
    promotable layers reserve their model-dtype copies too, so a promotion never
    overcommits."""
    elem = torch.tensor([], dtype=dtype).element_size()
    bs = cfg.cache.block_size
    layers = layers or spec.num_layers
    if not cfg.cache.kv_quantized:
        stored = torch.tensor([], dtype=kv_storage_dtype(cfg.cache, dtype)).element_size()
        per_token = layers * 2 * spec.num_kv_heads * spec.head_dim * stored
        return per_token * bs, per_token
    block = quantized_bytes_per_block(layers, bs, spec.num_kv_heads, spec.head_dim)
    promotable = min(cfg.cache.kv_promote_layers, spec.num_layers)
    reserve = 0
    if cfg.cache.kv_check_fraction > 0:
        reserve = promotable * 2 * bs * spec.num_kv_heads * spec.head_dim * elem
    return block + reserve, cdiv(block, bs)


def check_kv_groups(cfg: EngineConfig, groups: KVGroups) -> None:
    """Refuse, naming them, the features that need every layer to keep every block (a
    model with sliding-window layers keeps only their windows, in tables of their own)."""
    if not groups.hybrid:
        return
    refusals = (("kv_tiers.enabled", cfg.kv_tiers.enabled,
                 "the KV tiers store and restore a chain's blocks from its start"),
                ("speculative.method", cfg.speculative.method == "draft",
                 "a draft model reads the target's first block table from position 0"))
    for key, on, why in refusals:
        if on:
            raise ConfigError(f"{key}: not available for a model with sliding-window layers "
                              f"under cache.hybrid_kv ({why}; its {groups.num_groups} layer "
                              "group(s) drop the blocks behind their windows); set "
                              "cache.hybrid_kv = false to keep every block", key=key)


def describe_groups(groups: KVGroups) -> str:
    if groups.num_groups == 1:
        return "one block table per request"
    full = sum(w is None for w in groups.windows)
    windows = sorted({w for w in groups.windows if w is not None})
    return (f"{groups.num_groups} layer groups of {groups.num_slots} layers ({full} full "
            f"attention, {groups.num_groups - full} sliding over {', '.join(map(str, windows))} "
            "tokens), a block table each")


def longest_sequence(groups: KVGroups, num_blocks: int, block_size: int) -> int:
    """The most tokens one request alone can hold in `num_blocks` blocks."""
    full = sum(w is None for w in groups.windows)
    if not groups.hybrid:
        return num_blocks * block_size
    if full:   # each full group holds a block a position; sliding ones their windows
        window_blocks = sum(groups.blocks_for(w, w, block_size) // groups.num_groups
                            for w in groups.windows if w is not None)
        return max(0, num_blocks - window_blocks - full) // full * block_size
    return num_blocks * block_size


def check_kv_storage(cache, dtype: torch.dtype, device: torch.device) -> None:
    """A 2-byte cache.kv_dtype (bf16, fp16) differs from the model dtype only under a
    float32 model on the CPU, where the kernels widen it as they read it; elsewhere it must
    be the model's own dtype (the same as "auto")."""
    if cache.kv_dtype not in ("bf16", "fp16"):
        return
    stored = kv_storage_dtype(cache, dtype)
    if stored != dtype and (dtype != torch.float32 or device.type != "cpu"):
        raise ConfigError(
            f"cache.kv_dtype {cache.kv_dtype!r} under a {str(dtype).removeprefix('torch.')} "
            f"model on {device.type}: a 2-byte cache that differs from the model dtype needs "
            "model.dtype float32 on the CPU (or use 'auto', int8 or fp8)", key="cache.kv_dtype")


def size_kv_pool(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype,
                 device: torch.device, layers: int | None = None) -> tuple[int, int]:
    """Number of blocks from the budget (bytes on CPU, fraction of free memory on CUDA)."""
    per_block, per_token = kv_block_bytes(cfg, spec, dtype, layers)
    if cfg.cache.num_blocks:
        return cfg.cache.num_blocks, per_token
    if device.type == "cuda":
        # Loading leaves freed staging buffers in torch's cache, which mem_get_info counts
        # as used: return them first, or the pool is sized smaller than it can be.
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * cfg.cache.gpu_memory_utilization)
        if not cfg.graphs.enforce_eager:
            budget -= cfg.graphs.memory_budget_bytes  # held back for CUDA graph capture
    else:
        budget = cfg.cache.kv_cache_memory_bytes
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ConfigError(f"config error: the KV budget ({budget} bytes) is smaller than one "
                          f"block ({per_block} bytes); raise cache.kv_cache_memory_bytes")
    return num_blocks, per_token


def build_kv_event_publisher(config: EngineConfig, model_dir: str):
    """The ZMQ publisher of KV cache events when `[kv_events]` enables it, else None."""
    cfg = config.kv_events
    if not cfg.enable_kv_cache_events:
        return None
    from tokenloom.actors.kv.events_zmq import ZmqKVEventPublisher, default_topic
    topic = cfg.topic
    if topic == "auto":
        topic = default_topic(config.server.host, config.server.port,
                              config.server.served_model_name, model_dir)
    publisher = ZmqKVEventPublisher(cfg.endpoint, cfg.replay_endpoint or None,
                                    buffer_steps=cfg.buffer_steps, hwm=cfg.hwm,
                                    max_queue_size=cfg.max_queue_size, topic=topic,
                                    encoding=cfg.encoding)
    startup_log.info(f"KV events: publishing on {cfg.endpoint}"
                     + (f", replay on {cfg.replay_endpoint}" if cfg.replay_endpoint else "")
                     + f", topic {topic!r}, {cfg.encoding} encoding",
                     endpoint=cfg.endpoint, replay_endpoint=cfg.replay_endpoint or None,
                     topic=topic, encoding=cfg.encoding)
    return publisher


def build_lora(config: EngineConfig, spec: ModelSpec, model, dtype: torch.dtype,
               device: torch.device) -> tuple[AdapterSlots, LoRACache] | None:
    """`[lora]`: device slots for `max_loras` adapters attached to the model's projections,
    and the start-up adapters checked (a bad one stops start-up, naming it)."""
    cfg = config.lora
    if not cfg.enabled:
        return None
    stacks = LoRAStacks(spec, cfg.max_loras, cfg.max_lora_rank, dtype, device)
    kernel = None
    if device.type == "cuda":
        from tokenloom.kernels.gpu.triton_lora import lora_add_triton
        kernel = lora_add_triton
    model.enable_lora(stacks, kernel)
    cache = LoRACache(stacks, cfg.max_cpu_loras)
    for name, path in cfg.modules.items():
        try:
            cache.weights(name, path)
        except LoRAAdapterError as e:
            raise ConfigError(f"lora.modules: {e}", key="lora.modules") from e
    startup_log.info(f"LoRA: {cfg.max_loras} device slots of rank {cfg.max_lora_rank} "
                     f"({stacks.nbytes / 2**20:.0f} MiB), {len(cfg.modules)} adapters "
                     f"from start-up" + (f": {', '.join(cfg.modules)}" if cfg.modules else ""),
                     max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
                     adapters=sorted(cfg.modules))
    return AdapterSlots(cfg.max_loras, dict(cfg.modules)), cache


def build_speculation(config: EngineConfig, info: RuntimeInfo):
    """(SpecController, proposer, KV lookahead slots) for `[speculative]`, or Nones."""
    cfg = config.speculative
    if cfg.method == "off":
        return None, None, 0
    controller = SpecController(cfg.method, cfg.num_speculative_tokens, mode=cfg.mode,
                                reprobe_steps=cfg.reprobe_steps, min_gain=cfg.min_gain)
    if cfg.method == "ngram":
        proposer, lookahead = NgramProposer(cfg.ngram_min, cfg.ngram_max), 0
    else:
        from tokenloom.actors.speculation.draft_model import DraftModelProposer
        proposer = DraftModelProposer.load(cfg.draft_model, resolve_cache_dir(config), info,
                                           config.model.attention_backend,
                                           max_num_seqs=config.scheduler.max_num_seqs)
        lookahead = cfg.num_speculative_tokens
    startup_log.info(f"speculative decoding: {cfg.method}, k={cfg.num_speculative_tokens}, "
                     f"mode {cfg.mode}", method=cfg.method, k=cfg.num_speculative_tokens,
                     mode=cfg.mode)
    return controller, proposer, lookahead


class Engine(EngineFront):
    """Owns the actors; an EngineClient (actors/engine_client.py). Build with
    `Engine.build(config)`, then `await engine.run()`."""

    def __init__(self, config: EngineConfig, info: RuntimeInfo, model, tokenizer,
                 lora: tuple[AdapterSlots, LoRACache] | None = None):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        sc = config.scheduler
        device, dtype = info.torch_device, info.torch_dtype
        groups = info.kv_groups or KVGroups.single(info.spec.num_layers)
        # (a hybrid layout's pool reserves NULL_BLOCK for its tables' dropped entries)
        limits = PolicyLimits(max_num_seqs=sc.max_num_seqs,
                              max_num_batched_tokens=sc.max_num_batched_tokens,
                              block_size=info.block_size,
                              num_blocks=info.num_blocks - groups.hybrid,
                              kv_groups=info.kv_groups)
        eos = tuple(sorted(set(info.spec.eos_token_ids) | _tokenizer_eos(tokenizer)))
        self.info = info = msgspec.structs.replace(info, eos_token_ids=eos)
        cc = config.cache
        kv = KVCache.allocate(info.spec.num_layers, info.num_blocks, info.block_size,
                              info.spec.num_kv_heads, info.spec.head_dim,
                              kv_storage_dtype(cc, dtype) if not cc.kv_quantized else dtype,
                              device, kv_format(cc.side_dtype("k")),
                              kv_format(cc.side_dtype("v")), layer_slots=groups.layer_slot)
        self.kv = kv
        # Structured output: one compiler (and cache of compiled grammars) for the tokenizer
        # actor, which compiles and validates constraints off the loop, and the runner.
        self.guided = GuidedCompiler(tokenizer, info.spec.vocab_size, eos)
        # Wiring: tokenizer -> router -> scheduler <-> {KV manager, runner}, each actor given
        # the inboxes it sends to when it is built. The scheduler's inbox exists first: the
        # KV manager and the runner report to it.
        scheduler_inbox: asyncio.Queue = asyncio.Queue()
        self.router = RouterActor(sc.max_num_seqs, sc.max_waiting, self.streams.emit,
                                  scheduler_inbox)
        self.tokenizer_actor = TokenizerActor(
            tokenizer, info.max_model_len, self.streams.emit, self.router.inbox,
            guided=self.guided, max_prompt_logprobs_tokens=sc.max_prompt_logprobs_tokens)
        caching = config.cache.enable_prefix_caching
        block_bytes = info.kv_bytes_per_token * info.block_size
        host_pool, swap = None, None
        if sc.preemption_mode != "recompute":
            slots = HostKVPool.slots_for(config.cache.swap_space_bytes, block_bytes)
            if slots < 1:
                raise ConfigError(
                    f"scheduler.preemption_mode {sc.preemption_mode!r} needs swap space: "
                    f"cache.swap_space_bytes must be >= one KV block ({block_bytes} bytes), "
                    f"got {config.cache.swap_space_bytes}", key="cache.swap_space_bytes")
            host_pool = HostKVPool(kv.pool, slots, kv.scales)
            swap = SwapSpace(slots)
            startup_log.info(f"swap space: {slots} blocks of host memory "
                             f"({slots * block_bytes / 2**20:.0f} MiB), "
                             f"preemption mode {sc.preemption_mode}",
                             swap_blocks=slots, preemption_mode=sc.preemption_mode)
        spec_ctl, proposer, lookahead = build_speculation(config, info)
        if host_pool is not None and hasattr(proposer, "enable_swap"):
            draft_bytes = proposer.enable_swap(host_pool.num_slots)
            startup_log.info(f"swap space: the draft model's KV of the same {host_pool.num_slots} "
                             f"blocks takes {draft_bytes / 2**20:.0f} MiB more host memory",
                             draft_swap_mib=round(draft_bytes / 2**20, 1))
        publisher = build_kv_event_publisher(config, info.model_dir)
        self.tiers = build_tiers(config.kv_tiers, KVLayout(
            info.dtype if info.kv_dtype == "auto" else (
                info.kv_dtype + ("" if info.kv_rotation == "none" else f"+{info.kv_rotation}")),
            (info.spec.num_layers, 2, info.block_size, info.spec.num_kv_heads,
             info.spec.head_dim), kv.pool.element_size(), info.fingerprint,
            scale_bytes=0 if kv.scales is None else kv.scales[:, :, 0].numel() * 4),
            info.block_size, prefix_caching=caching, speculative_method=config.speculative.method)
        kv_replies: asyncio.Queue = asyncio.Queue()
        self.kv_manager = KVManagerActor(KVCacheManager(info.num_blocks, info.block_size,
                                                        enable_prefix_caching=caching,
                                                        groups=info.kv_groups),
                                         replies=kv_replies, scheduler_inbox=scheduler_inbox,
                                         publisher=publisher, tiers=self.tiers)
        from tokenloom.graphs.setup import build_decode_graphs, build_piecewise_graphs
        dispatcher, graphs = build_decode_graphs(
            config.graphs, model, kv, max_num_seqs=sc.max_num_seqs,
            max_model_len=info.max_model_len, device=device,
            cache_dir=resolve_cache_dir(config))
        piecewise = build_piecewise_graphs(config.graphs, model, kv, dispatcher, graphs,
                                           max_num_batched_tokens=sc.max_num_batched_tokens,
                                           device=device)
        # Start-up may have dropped Triton decode attention (a variant failed to compile):
        # report the backend that runs.
        if info.attention_backend == "triton" and model.layers[0].self_attn.decode_fn is None:
            self.info = info = msgspec.structs.replace(info, attention_backend="torch")
        self.runner = RunnerActor(ModelRunner(model, kv, device, eos, graphs, dispatcher,
                                              host_pool=host_pool, proposer=proposer,
                                              guided=self.guided, piecewise=piecewise,
                                              tiers=self.tiers,
                                              lora=lora[1] if lora is not None else None),
                                  scheduler_inbox)
        self.runner.lora_snapshot = self.runner.model_runner.lora_stats()
        self.runner.pooled_sink = self.streams.deliver   # embeddings (SamplingParams.pooling)
        core = Scheduler(limits, eos, info.max_model_len, self._emit_scheduled,
                         PrefixTracker(info.fingerprint, info.block_size, caching),
                         config=sc, swap=swap, block_bytes=block_bytes,
                         outputs=OutputProcessor(tokenizer), spec=spec_ctl,
                         spec_lookahead=lookahead, tiers=self.tiers if caching else None,
                         recompute_prior_s_per_token=(
                             config.kv_tiers.recompute_prior_ms_per_token / 1e3),
                         lora=lora[0] if lora is not None else None,
                         long_rope_window=long_rope_window(info.spec))
        self.scheduler = SchedulerActor(core, inbox=scheduler_inbox,
                                        kv_inbox=self.kv_manager.inbox, kv_replies=kv_replies,
                                        runner=self.runner)
        # The adapters a request may name (the front's list; the scheduler has its own
        # registry, told of every change); None: LoRA serving is off.
        self.lora_adapters: dict[str, str] | None = (
            dict(config.lora.modules) if lora is not None else None)
        self._start_kv_check(model, kv)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _start_kv_check(self, model, kv: KVCache) -> None:
        """The runtime quality check of a quantized KV cache (cache.kv_check_fraction)."""
        cc, info = self.config.cache, self.info
        runner = self.runner.model_runner
        if kv.quantized and cc.kv_check_fraction > 0:
            max_kl, max_error = auto_budgets(cc.side_dtype("k"), cc.side_dtype("v"),
                                             cc.kv_check_max_kl, cc.kv_check_max_error)
            check = KVQualityCheck(
                info.spec.num_layers, info.block_size, info.spec.num_kv_heads,
                info.spec.head_dim, info.torch_device, fraction=cc.kv_check_fraction,
                max_kl=max_kl, max_error=max_error,
                max_promotions=min(cc.kv_promote_layers, info.spec.num_layers),
                seed=self.config.model.seed)
            runner.kv_check = check
            model.set_kv_check(check)
            startup_log.info(
                f"KV quality check: {cc.kv_check_fraction:.1%} of decode steps compared with "
                f"a full-precision shadow (budgets: attention KL {max_kl} nats, K/V error "
                f"{max_error}); up to {check.max_promotions} layers may "
                "be promoted", fraction=cc.kv_check_fraction)
        self.runner.kv_quant_labels = (info.kv_dtype, info.kv_bytes_per_token,
                                       info.kv_rotation)
        self.runner.kv_quant_snapshot = runner.kv_quant_stats(*self.runner.kv_quant_labels)

    @property
    def actors(self) -> tuple:
        return (self.tokenizer_actor, self.router, self.scheduler, self.kv_manager, self.runner)

    def _emit_scheduled(self, out: RequestOutput) -> None:
        """Outputs of admitted requests: to their stream; a finish also tells the router."""
        self.streams.emit(out)
        if out.finished:
            self.router.send(RequestFinished(request_id=out.request_id))

    @classmethod
    def build(cls, config: EngineConfig) -> "Engine":
        """Load the model and make the actors, on the engine's compute thread, which then
        runs every step (actors/execution/compute_thread.py says why one thread matters)."""
        compute = ComputeThread()
        try:
            engine = compute.call(cls._build, config)
        except BaseException:
            compute.stop()
            raise
        engine.runner.compute = compute
        return engine

    @classmethod
    def _build(cls, config: EngineConfig) -> "Engine":
        device = pick_device(config.model.device)
        dtype = pick_dtype(config.model.dtype, device)
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        torch.manual_seed(config.model.seed)
        t0 = time.perf_counter()
        model_dir = resolve_model_dir(config.model.model, resolve_cache_dir(config))
        spec = load_spec(model_dir)
        max_len = config.model.max_model_len or spec.max_position_embeddings
        check_kv_storage(config.cache, dtype, device)
        model, spec = load_model(model_dir, dtype, device, max_positions=max_len)
        model.plan_cache_dir = resolve_cache_dir(config)   # the CPU kernel choice, remembered
        backend = select_decode_backend(model, config.model.attention_backend, device,
                                        max_model_len=max_len,
                                        block_size=config.cache.block_size,
                                        kv_quantized=config.cache.kv_quantized)
        # (LoRA slots first: on a GPU the KV pool is sized from the memory left)
        lora = build_lora(config, spec, model, dtype, device)
        if not config.cache.hybrid_kv:
            model.use_one_kv_table()
        groups = model.kv_groups
        check_kv_groups(config, groups)
        num_blocks, per_token = size_kv_pool(config, spec, dtype, device, groups.num_slots)
        capacity = longest_sequence(groups, num_blocks - groups.hybrid, config.cache.block_size)
        if capacity < max_len:
            # Any single request must fit alone, or a lone request could preempt itself forever.
            startup_log.info(f"max_model_len lowered from {max_len} to the KV capacity of "
                             f"{capacity} tokens", max_model_len=capacity)
            max_len = capacity
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        digest = weights_digest(model_dir, resolve_cache_dir(config))
        # model.weight_dtype int8: quantize, then pass the quality gate or refuse to start.
        apply_weight_dtype(model, model_dir, config.model, dtype, device, tokenizer, digest,
                           resolve_cache_dir(config))
        # cache.kv_dtype quantized: rotate q/k/v if asked, then pass the KV quality gate
        # (measured with the rotation) or refuse to start.
        rotation = resolve_rotation(config.cache, spec.head_dim)
        if rotation == "hadamard":
            model.set_kv_rotation(hadamard(spec.head_dim, torch.float32, device))
        apply_kv_gate(model, config.cache, tokenizer, digest, dtype, resolve_cache_dir(config),
                      rotation)
        info = RuntimeInfo(model_dir=str(model_dir), spec=spec, device=str(device),
                           dtype=str(dtype).removeprefix("torch."), num_blocks=num_blocks,
                           block_size=config.cache.block_size, kv_bytes_per_token=per_token,
                           max_model_len=max_len, attention_backend=backend,
                           weights_digest=digest, kv_dtype=kv_dtype_name(config.cache),
                           kv_rotation=rotation,
                           fingerprint=model_fingerprint(digest, str(dtype),
                                                         config.cache.block_size),
                           kv_groups=groups if groups.hybrid else None)
        seconds = time.perf_counter() - t0
        startup_log.info(f"model {spec.architecture} from {model_dir} "
                         f"({str(dtype).removeprefix('torch.')}, {device}) "
                         f"loaded in {seconds:.1f}s",
                         model_dir=str(model_dir), seconds=round(seconds, 1))
        if config.cache.kv_quantized:
            elem = f"1 byte ({info.kv_dtype}) + scales"
        else:
            stored = kv_storage_dtype(config.cache, dtype)
            elem = (f"{torch.tensor([], dtype=stored).element_size()} bytes"
                    + ("" if stored == dtype else f" ({info.kv_dtype})"))
        startup_log.info(
            f"KV cache: {num_blocks} blocks x {info.block_size} tokens, "
            f"{per_token} bytes/token a block ({groups.num_slots} layers x 2 x "
            f"{spec.num_kv_heads} kv heads x {spec.head_dim} head dim x {elem}), "
            f"{num_blocks * per_token * info.block_size / 2**20:.0f} MiB; "
            f"{describe_groups(groups)}; one sequence up to {capacity} tokens",
            num_blocks=num_blocks, block_size=info.block_size, capacity_tokens=capacity,
            kv_dtype=info.kv_dtype, kv_groups=groups.num_groups)
        return cls(config, info, model, tokenizer, lora)

    # -- running -------------------------------------------------------------------------
    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        try:
            async with asyncio.TaskGroup() as tg:
                for actor in self.actors:
                    task = tg.create_task(actor.run(), name=actor.name)
                    if actor is self.scheduler:
                        task.add_done_callback(lambda _: self._stop_back_end())
        finally:
            self._release_memory()

    def _release_memory(self) -> None:
        """The actors have stopped: let go of what holds memory (the weights, the KV pool,
        the host swap pool, captured graphs, the draft model), so that a process building
        engine after engine (the test suite, a notebook) gets it back even while something
        still references the engine itself — aiohttp, for one, caches each application's
        middleware chain (up to 1,024 of them), and the application holds the engine."""
        runner = self.runner.model_runner
        for name in ("model", "kv", "host_pool", "graphs", "piecewise", "proposer", "lora"):
            setattr(runner, name, None)
        self.kv = None
        if self.info.torch_device.type == "cpu":
            from tokenloom.kernels.cpu.allocator import release_freed_memory, weight_arena
            weight_arena().retire()     # its last chunk: its weights may be gone
            release_freed_memory()      # the heap's free pages (keep_freed_memory keeps them)

    def shutdown(self) -> None:
        """Stop front to back. The KV manager and runner serve only the scheduler, which may
        be mid-step (waiting for a grant or a step output): they stop once it has stopped,
        or it would wait forever for a reply."""
        for actor in (self.tokenizer_actor, self.router, self.scheduler):
            actor.send(Shutdown())

    def _stop_back_end(self) -> None:
        for actor in (self.kv_manager, self.runner):
            actor.send(Shutdown())

    # -- the EngineClient queries ---------------------------------------------------------
    async def trace(self, request_id: str) -> dict | None:
        """The trace of a recent request by the id the client saw: one engine request's
        trace, or {"request_id", "choices": [...]} when the id stands for several (n > 1 or
        several prompts); None when no such request is in the bounded history."""
        return merge_traces(request_id,
                            await self.ask(self.scheduler, GetTrace(request_id=request_id)))

    async def flush_prefix_cache(self, force: bool = False):
        """Admin `flush`: drop the cached prefix blocks -> FlushResult."""
        return await self.ask(self.kv_manager, FlushPrefixCache(force=force))

    async def stats(self) -> EngineStats:
        """One typed snapshot of the engine for admin `stats` and /metrics."""
        return EngineStats(scheduler=await self.ask(self.scheduler, GetSchedulerStats()),
                           kv=await self.ask(self.kv_manager, GetKVStats()),
                           router=await self.ask(self.router, GetRouterStats()),
                           graphs=self.runner.graph_snapshot,
                           kv_quant=self.runner.kv_quant_snapshot,
                           lora_loads=self.runner.lora_snapshot)

    def stalled_seconds(self) -> float:
        """0.0 when the engine is idle or making progress, else the seconds since it last
        completed a step while work is queued or running. Synchronous and inbox-free, so it
        works while the engine is wedged (for /health and the systemd watchdog)."""
        return self.scheduler.stalled_seconds()

    def worker_status(self) -> list[WorkerStatus]:
        return []   # one process: no workers

    def degraded_tiers(self) -> dict[str, str]:
        """KV tiers whose medium is failing now (tier -> reason): /health reports them."""
        return self.tiers.degraded if self.tiers is not None else {}

    async def worker_stats(self) -> WorkerStats | None:
        return None

    async def set_draining(self, draining: bool) -> None:
        """Nothing below the front to tell: the HTTP layer stops admitting by itself."""

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Check the adapter at `path` against the base model (LoRAAdapterError naming
        it when it cannot be served) and let requests name it."""
        if self.lora_adapters is None:
            raise LoRAAdapterError("LoRA serving is off (lora.enable)")
        spec, max_rank = self.info.spec, self.config.lora.max_lora_rank
        await asyncio.to_thread(load_adapter, name, path, spec, max_rank)
        await self.ask(self.scheduler, SetLoRAAdapter(name=name, path=str(path)))
        self.lora_adapters[name] = str(path)

    async def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving an adapter; whether it was loaded."""
        if self.lora_adapters is None or self.lora_adapters.pop(name, None) is None:
            return False
        await self.ask(self.scheduler, SetLoRAAdapter(name=name, path=None))
        return True

    async def ask(self, actor, query):
        """Send a typed query (messages.py, "control") to an actor and await its answer."""
        query.reply = asyncio.get_running_loop().create_future()
        actor.send(query)
        return await query.reply


def _tokenizer_eos(tokenizer) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if isinstance(eos, int) else set()
