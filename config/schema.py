"""The configuration tree: one frozen msgspec Struct per subsystem.

Contract:
- Every struct validates itself on construction, whether built directly in Python
  (`EngineConfig(cache=CacheConfig(block_size=32))`) or by `msgspec.convert` from a mapping
  (see `tokenloom.config.load`). Invalid values raise `ConfigError` naming the dotted key
  (`scheduler.max_num_seqs`) and the allowed range or values.
- Structs are frozen: a config never changes after creation. Values measured at run time
  (e.g. the number of KV blocks that fit) belong in a separate runtime-info object.
- Each actor receives only its own branch (`cfg.scheduler`, `cfg.cache`, ...).

This module must not import torch: the daemon's CLI validates config before loading it.
"""

from __future__ import annotations

import os
import pathlib
import re
from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

import msgspec

from tokenloom.config.validation import ConfigError, check_field, field_types

__all__ = [
    "AdminConfig",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "GraphsConfig",
    "ModelConfig",
    "SchedulerConfig",
    "ServerConfig",
    "SpeculativeConfig",
    "KVEventsConfig",
    "KVTiersConfig",
    "LoRAConfig",
    "RecordConfig",
    "WorkersConfig",
    "check_field",
    "field_types",
    "resolve_cache_dir",
]

MiB = 1 << 20


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of the per-subsystem structs: validates every field on construction.

    msgspec enforces `Meta` constraints only when decoding/converting, not in `__init__`;
    checking in `__post_init__` makes direct construction just as safe. Subclasses that
    add cross-field rules call `super().__post_init__()` first.
    """

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for name in field_types(type(self)):
            check_field(type(self), name, getattr(self, name))


class ModelConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which model to serve and how to place it."""

    section: ClassVar[str] = "model"

    # "default" is the bundled SmolLM2-135M-Instruct; anything else is a local HF directory.
    model: Annotated[str, msgspec.Meta(min_length=1)] = "default"
    # auto: float32 on CPU, bfloat16 on CUDA.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # "auto", "cpu", "cuda" (the current CUDA device) or "cuda:N" (GPU N: one daemon per
    # GPU, see systemd/tokenloom@.service).
    device: str = "auto"
    # Where converted weights live; "" means $XDG_CACHE_HOME/tokenloom or ~/.cache/tokenloom.
    cache_dir: str = ""
    # 0 takes the model's own context length.
    max_model_len: Annotated[int, msgspec.Meta(ge=0)] = 0
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0
    # 0 leaves torch's default thread count alone.
    num_threads: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    # Decode attention: "auto" = the C++ paged kernel on CPU (torch reference if it cannot
    # be built), the Triton kernels on CUDA (torch reference if their start-up smoke test
    # fails); "torch" forces the reference everywhere.
    attention_backend: Literal["auto", "torch", "cpu_kernel", "triton"] = "auto"
    # How the projection weights are stored: "auto" = in model.dtype; "int8" = weight-only
    # int8 with per-channel scales (CPU); "q4" = 4-bit blocks of 32 with scale + min (GGUF
    # Q4_1; the default model's file is served as it ships), LM head in q8; "q8" = 8-bit
    # blocks of 32 (GGUF Q8_0). Activations and KV stay in model.dtype. A quantized mode
    # must pass its quality gate against fp32 at start-up (kernels/models/quality_gate.py).
    weight_dtype: Literal["auto", "int8", "q4", "q8"] = "auto"
    # Start a quantized weight mode even when it fails its quality gate (logged loudly).
    force_quantized: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,3})?", self.device):
            raise ConfigError(f"model.device must be auto, cpu, cuda or cuda:N (N a GPU "
                              f"index, e.g. cuda:1), got {self.device!r}", key="model.device")


# cache.kv_dtype values that store K/V as plain 2-byte floats (no scales).
HALF_KV_DTYPES = ("bf16", "fp16")


class CacheConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The paged KV cache: block geometry and the memory it may take."""

    section: ClassVar[str] = "cache"

    block_size: Literal[8, 16, 32, 64, 128] = 16
    # Budget for the KV cache when running on the CPU.
    kv_cache_memory_bytes: Annotated[int, msgspec.Meta(ge=MiB)] = 1 << 30
    # Fraction of GPU memory the whole engine may use (weights + activations + KV).
    gpu_memory_utilization: Annotated[float, msgspec.Meta(gt=0.0, lt=1.0)] = 0.9
    # 0 derives the block count from the memory budget; tests set it to force preemption.
    num_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Reuse the KV of full blocks whose whole prefix (tokens, model, salt) was seen before.
    enable_prefix_caching: bool = True
    # A model with sliding-window layers keeps only their windows' blocks, in block tables
    # of their own (actors/kv/groups.py); false: every layer keeps the whole context in one
    # table (what the KV tiers and a draft model need; the windows still apply).
    hybrid_kv: bool = True
    # Host-memory pool for swap preemption (scheduler.preemption_mode swap/auto only).
    swap_space_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * MiB
    # How K and V are stored: "auto" = the model dtype; "bf16", "fp16" = two bytes per value
    # under a float32 model on the CPU (half the KV bytes a decode step reads; llama.cpp's
    # default cache is fp16), else only the model's own dtype; "int8", "fp8_e4m3",
    # "fp8_e5m2" = one byte per value with a scale per token and KV head, computed as rows
    # are written (docs/kv-quantization.md). k_dtype / v_dtype override a 1-byte kv_dtype per
    # side ("" = kv_dtype); K and V are either both quantized or both not.
    kv_dtype: Literal["auto", "bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    k_dtype: Literal["", "auto", "int8", "fp8_e4m3", "fp8_e5m2"] = ""
    v_dtype: Literal["", "auto", "int8", "fp8_e4m3", "fp8_e5m2"] = ""
    # Rotate q, k and v by a Walsh-Hadamard matrix before a quantized cache (spreads an
    # outlier channel over the head before it sets the row's scale): "auto" = on for a
    # quantized cache with a power-of-two head dim; "none"; "hadamard" (quantized only).
    kv_rotation: Literal["auto", "none", "hadamard"] = "auto"
    # Start a quantized KV mode even when it fails its start-up quality gate (logged loudly).
    force_kv_dtype: bool = False
    # Runtime quality check of a quantized KV cache: the fraction of decode steps on which
    # one row's attention is recomputed against a full-precision shadow of its last block
    # (0 = off). Over budget (attention KL in nats, or the relative error of the shadowed
    # rows; 0 = the format's own budget, kernels/kv_quality_check.py) the layer is
    # promoted: new blocks are kept in the model dtype too.
    kv_check_fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.02
    kv_check_max_kl: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    kv_check_max_error: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 0.0
    # Layers the check may promote; their model-dtype copies are reserved from the budget.
    kv_promote_layers: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_dtype in HALF_KV_DTYPES:
            for name in ("k_dtype", "v_dtype"):
                if getattr(self, name):
                    raise ConfigError(
                        f"cache.{name} overrides a 1-byte cache.kv_dtype only; with kv_dtype "
                        f"{self.kv_dtype!r} leave it unset (got {getattr(self, name)!r})",
                        key=f"cache.{name}")
        quantized = [name for name in ("k_dtype", "v_dtype")
                     if self.side_dtype(name[0]) not in ("auto", *HALF_KV_DTYPES)]
        if len(quantized) == 1:
            raise ConfigError(
                f"cache.k_dtype and cache.v_dtype must both be quantized or both 'auto', got "
                f"k_dtype {self.side_dtype('k')!r}, v_dtype {self.side_dtype('v')!r}",
                key=f"cache.{quantized[0]}")
        if self.kv_rotation == "hadamard" and not quantized:
            raise ConfigError("cache.kv_rotation 'hadamard' applies to a quantized cache only: "
                              "set cache.kv_dtype too (int8, fp8_e4m3, fp8_e5m2)",
                              key="cache.kv_rotation")

    def side_dtype(self, side: str) -> str:
        """The storage of K (`side` "k") or V ("v"): its override, else kv_dtype."""
        return getattr(self, f"{side}_dtype") or self.kv_dtype

    @property
    def kv_quantized(self) -> bool:
        """K/V in a 1-byte format with scales (int8, fp8)."""
        return self.side_dtype("k") not in ("auto", *HALF_KV_DTYPES)


class SchedulerConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Batch limits and fairness for the continuous-batching scheduler."""

    section: ClassVar[str] = "scheduler"

    max_num_seqs: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    max_num_batched_tokens: Annotated[int, msgspec.Meta(ge=16, le=1_000_000)] = 2048
    # K of design invariant 3: a running stream is skipped at most K iterations in a row.
    max_decode_skip: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 4
    max_waiting: Annotated[int, msgspec.Meta(ge=1)] = 1024
    # On KV exhaustion a victim either drops its KV and recomputes it later, or copies it
    # to a host-memory pool (cache.swap_space_bytes) and back; "auto" picks per victim by
    # estimated cost (recompute time from the step-cost model vs copy time).
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"
    # Prefill chunk size: "slo" sizes each iteration's prefill tokens from a step-time cost
    # model fitted online so that running decodes keep `target_itl_ms`; "static" always
    # fills max_num_batched_tokens.
    chunking: Literal["slo", "static"] = "slo"
    # Target inter-token latency for "slo" chunking; 0 = auto_itl_factor times the
    # predicted time of an iteration with only the running decodes.
    target_itl_ms: Annotated[float, msgspec.Meta(ge=0.0, le=600_000.0)] = 0.0
    # The automatic target's multiple of a decode-only iteration: how much slower than a
    # pure decode step a mixed prefill+decode step may be while streams are decoding.
    auto_itl_factor: Annotated[float, msgspec.Meta(ge=1.0, le=100.0)] = 1.5
    # Overlapped steps: plan and launch step N+1 while step N runs, and process N's outputs
    # meanwhile (one step ahead); false = the serial loop (plan, run, wait, process).
    overlap: bool = True
    # Fewest prefill tokens per iteration under "slo", so long prompts always progress.
    # 0 = follow target_itl_ms down to one KV block (cache.block_size tokens); a value > 0
    # is a floor in time, kept even when it overruns the target: an iteration may take as
    # long as its decodes plus that many tokens at a prompt's start (deeper into a long
    # prompt, the most tokens that fit that time, at least one KV block).
    min_prefill_chunk: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 64
    # KV plan: fraction of the pool admission keeps free...
    kv_watermark: Annotated[float, msgspec.Meta(ge=0.0, le=0.5)] = 0.01
    # ... raised to this fraction after a preemption until the pool recovers (hysteresis).
    kv_resume_watermark: Annotated[float, msgspec.Meta(ge=0.0, le=0.9)] = 0.05
    # Growth projected at admission for every running request and the candidate, in tokens
    # (bounded by each one's max_tokens): admit only what can grow this far without preempting.
    admission_lookahead_tokens: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 64
    # Request classes: name -> priority number (lower runs first) for `priority` given as a
    # name or the X-Priority header; numbers are accepted directly too.
    priority_classes: dict[str, int] = msgspec.field(
        default_factory=lambda: {"interactive": 0, "batch": 10})
    # Fair share between tenants (`user` field or X-Tenant header): relative weights;
    # tenants not listed weigh 1.
    tenant_weights: dict[str, float] = msgspec.field(default_factory=dict)
    # Aging: a waiting request gains one priority class per this many seconds (0 = never).
    aging_seconds: Annotated[float, msgspec.Meta(ge=0.0)] = 30.0
    # Per-request traces kept for GET /v1/requests/{id}/trace (most recent first out).
    trace_history: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1000
    # Goodput: a finished request is "good" when its TTFT and mean inter-token latency are
    # within these (0 = that SLO is not checked).
    slo_ttft_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    slo_itl_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    # Longest prompt (tokens) a request asking for prompt logprobs (`prompt_logprobs`, or
    # `echo` with `logprobs` over HTTP) may have; longer ones are refused with a 400 naming
    # prompt_logprobs. Each such prompt token costs a full-vocabulary LM-head row and k + 1
    # logprobs carried back to the client.
    max_prompt_logprobs_tokens: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, value in self.priority_classes.items():
            if not name or isinstance(value, bool) or not isinstance(value, int) \
                    or not -(2**31) <= value < 2**31:
                raise ConfigError(f"scheduler.priority_classes.{name or '<empty>'} must be a "
                                  f"32-bit integer, got {value!r}",
                                  key="scheduler.priority_classes")
        for name, value in self.tenant_weights.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"scheduler.tenant_weights.{name} must be a number > 0, "
                                  f"got {value!r}", key="scheduler.tenant_weights")
        if self.kv_resume_watermark < self.kv_watermark:
            raise ConfigError(
                "scheduler.kv_resume_watermark must be >= scheduler.kv_watermark, got "
                f"{self.kv_resume_watermark} < {self.kv_watermark}",
                key="scheduler.kv_resume_watermark")
        # Every running sequence must be able to get at least one token per iteration.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "scheduler.max_num_batched_tokens must be >= scheduler.max_num_seqs, got "
                f"max_num_batched_tokens={self.max_num_batched_tokens} < "
                f"max_num_seqs={self.max_num_seqs}",
                key="scheduler.max_num_batched_tokens",
            )


class ServerConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The HTTP front end (`tokenloom serve`); CLI --host/--port override host and port."""

    section: ClassVar[str] = "server"

    host: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000
    # Larger request bodies are refused with 413 before they are read.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 4 * MiB
    # Most completions one request may ask for (`n`).
    max_n: Annotated[int, msgspec.Meta(ge=1, le=128)] = 16
    # The model id clients send and /v1/models lists; "" derives it from model.model.
    served_model_name: str = ""
    # Seconds a client is told to wait (Retry-After) when the waiting queue is full.
    retry_after_seconds: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 1
    # On SIGTERM/SIGINT, seconds to let running requests finish before cancelling them.
    drain_timeout_seconds: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # /health fails (503) and systemd watchdog pings stop once the engine has gone this
    # many seconds without completing a step while work is queued (a wedged runner).
    health_stall_seconds: Annotated[float, msgspec.Meta(ge=0.1, le=3600.0)] = 30.0
    # Slow and abusive clients (issue 17): what one request may ask for is bounded by
    # config, not by memory. max_tokens 0 = the context window.
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 0
    max_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] = 20
    # Connections beyond this get a 503 and are closed before anything is read.
    max_connections: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1024
    # A request's headers, and its body, must arrive within these (slow-loris clients).
    header_timeout_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 10.0
    body_timeout_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    # A streaming client whose socket takes no data for this long is disconnected and its
    # requests aborted, so a slow reader holds no engine slot past it (and the data queued
    # for it stays bounded by the kernel's and the transport's buffers).
    write_timeout_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    keepalive_timeout_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 75.0
    # How a model's thinking is split from its answer (reasoning_content, Responses'
    # reasoning items, Messages' thinking blocks): "auto" picks by the served model (the
    # <think> parser for a chat template that emits <think>, or Qwen3), "none" splits
    # nothing; the names are daemon/openai/reasoning.py's registry (--reasoning-parser).
    reasoning_parser: Literal["auto", "none", "think", "qwen3", "deepseek_r1"] = "auto"
    # POST /v1/embeddings with the served model beside generation (--embeddings), pooled as
    # the model directory's sentence-transformers config says (last token by default).
    embeddings: bool = False
    # POST /v1/responses with store=true: responses kept in memory for previous_response_id
    # (and GET /v1/responses/{id}), the oldest dropped beyond this many (0: store refused),
    # each for at most responses_store_ttl_seconds.
    responses_store_size: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1024
    responses_store_ttl_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=7 * 86400.0)] = 3600.0


class GraphsConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Static decode programs for bucketed batch sizes: CUDA graphs on a GPU, compiled
    programs (torch.compile) on CPU."""

    section: ClassVar[str] = "graphs"

    # True: never capture; every step runs eager (debugging, or to save capture time).
    enforce_eager: bool = False
    # Batch sizes to capture; empty = 1, 2, 4, 8, 16, 24, 32, ... up to max_capture_size.
    capture_sizes: list[int] = []
    # Largest bucket; 0 = scheduler.max_num_seqs (larger decode batches run eager).
    max_capture_size: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0
    # A JSON file {batch_size: count} of observed decode batch sizes (the runner's
    # `decode_batch_size_histogram` stat); when set, buckets minimise padding over it.
    histogram_path: str = ""
    # Most buckets derived from a histogram.
    max_graphs: Annotated[int, msgspec.Meta(ge=1, le=512)] = 16
    # Device memory the captured graphs may take; more falls back to eager. On CUDA this
    # much is held back from the KV pool.
    memory_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1 << 30
    # CPU: compile a static-shape decode program per bucket at start-up (torch.compile,
    # cached on disk under cache_dir; graphs/cpu_compile.py). false: every step runs eager.
    cpu_compile: bool = False
    # CPU buckets (decode batches up to the largest are padded to the next one); a CPU
    # compiles each for tens of seconds on a cold cache, so fewer than on CUDA.
    cpu_capture_sizes: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4, 8, 16])
    # CUDA: steps with prefill tokens (and decode batches above the largest bucket) replay
    # piecewise graphs, everything but attention, per token-count bucket (graphs/piecewise.py).
    piecewise: bool = True
    # Largest piecewise bucket, in tokens (capped by scheduler.max_num_batched_tokens);
    # larger steps run eager. Buckets: 8, 16, 24, 32, 48, 64, then 8 per doubling.
    piecewise_max_tokens: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 2048
    # Explicit piecewise buckets (tokens); empty = the series above.
    piecewise_token_sizes: list[int] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        for key, top in (("capture_sizes", 4096), ("cpu_capture_sizes", 4096),
                         ("piecewise_token_sizes", 65536)):
            bad = [s for s in getattr(self, key)
                   if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= top]
            if bad:
                raise ConfigError(f"graphs.{key} must be integers in 1..{top}, got {bad!r}",
                                  key=f"graphs.{key}")


class SpeculativeConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Speculative decoding: a proposer guesses the next tokens, the model verifies them in
    one forward, and rejection sampling keeps the output distribution exact. Off by default,
    as in vLLM; each request may still say `speculative: "off"` (or "on")."""

    section: ClassVar[str] = "speculative"

    # "ngram": prompt lookup (the longest recent n-gram seen before proposes what followed
    # it; no extra model). "draft": a smaller model sharing the tokenizer (`draft_model`).
    method: Literal["off", "ngram", "draft"] = "off"
    # Proposed tokens per step (k); the kill switch may use fewer.
    num_speculative_tokens: Annotated[int, msgspec.Meta(ge=1, le=16)] = 4
    # "auto": speculate only while the cost model says it pays (accepted tokens per step
    # against the step's measured extra cost), per request and for the whole batch;
    # "on": whenever there is a proposal. A request's own `speculative` field overrides.
    mode: Literal["auto", "on"] = "auto"
    # n-gram lengths tried, longest first, when matching the end of the sequence.
    ngram_min: Annotated[int, msgspec.Meta(ge=1, le=64)] = 2
    ngram_max: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    # Draft model: a local model directory or "default" (must share the tokenizer's vocab).
    draft_model: str = ""
    # auto: a request that stopped speculating is re-probed with one speculative step after
    # this many decode steps (n-gram requests are also scored on proposals not sent).
    reprobe_steps: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 16
    # auto: speculate only when the predicted tokens/s gain exceeds this fraction.
    min_gain: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 0.05

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ngram_max < self.ngram_min:
            raise ConfigError(f"speculative.ngram_max must be >= speculative.ngram_min "
                              f"({self.ngram_min}), got {self.ngram_max}",
                              key="speculative.ngram_max")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError('speculative.draft_model must name a model directory (or '
                              '"default") when speculative.method is "draft", got ""',
                              key="speculative.draft_model")


class KVEventsConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """KV cache events on a ZMQ PUB socket in vLLM's wire format (vLLM's kv_events_config
    names), for KV-aware routers: see actors/kv/events_zmq.py and events_wire.py."""

    section: ClassVar[str] = "kv_events"

    enable_kv_cache_events: bool = False
    # A wildcard host or ipc:// path is bound; a concrete host:port is connected to.
    endpoint: Annotated[str, msgspec.Meta(min_length=1)] = "tcp://*:5557"
    # ROUTER socket for replaying missed batches ("" = no replay).
    replay_endpoint: str = ""
    buffer_steps: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 10_000
    hwm: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 100_000
    max_queue_size: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 100_000
    # First frame of every message; "auto" = kv@<server.host>:<server.port>@<served model
    # name> (llm-d's kv@<pod>@<model>; a wildcard host is replaced by the host name).
    topic: str = "auto"
    # Events as vLLM now encodes them ("map": tagged maps) or as positional arrays ("array":
    # vLLM's earlier form, for older consumers). The batch is positional either way.
    encoding: Literal["map", "array"] = "map"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"kv_events.{name} must be a ZMQ endpoint (tcp://host:port, "
                                  f"ipc://path or inproc://name), got {value!r}",
                                  key=f"kv_events.{name}")


TierWrite = Literal["back", "through", "off"]


class KVTiersConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """KV blocks below the device pool: host RAM, local disk and a Redis-protocol remote
    store, with a restore planner (actors/kv/tiers/; docs/kv-tiers.md). Needs prefix
    caching. A tier is on when its size (host, disk) or URL (remote) is set."""

    section: ClassVar[str] = "kv_tiers"

    enabled: bool = False
    # "cost": restore only what is predicted cheaper than recomputing (per request, at the
    # current load); "always_restore", "always_recompute" and "threshold:N" (restore when at
    # least N tokens are available) are the fixed rules, for comparison.
    planner: str = "cost"
    host_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1024 * MiB
    disk_path: str = ""
    disk_bytes: Annotated[int, msgspec.Meta(ge=0)] = 8192 * MiB
    disk_fsync: bool = False
    remote_url: str = ""
    remote_timeout_ms: Annotated[float, msgspec.Meta(gt=0.0, le=60_000.0)] = 500.0
    remote_ttl_s: Annotated[int, msgspec.Meta(ge=0)] = 0
    remote_retry_after_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 1.0
    # Benchmarks only: emulate a slower link on the client side ([latency ms, MB/s]).
    remote_shaping: list[float] = []
    # Write policy per tier: "back" (what leaves the tier above comes down), "through"
    # (also every block as the device computes it) or "off"; store_threshold N > 0 stores
    # only blocks looked up at least N times.
    host_write: TierWrite = "back"
    disk_write: TierWrite = "back"
    remote_write: TierWrite = "back"
    host_store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    disk_store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    remote_store_threshold: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    # Priors of the transfer models (replaced by measurements as transfers complete).
    host_prior_mb_s: Annotated[float, msgspec.Meta(gt=0.0)] = 4000.0
    disk_prior_mb_s: Annotated[float, msgspec.Meta(gt=0.0)] = 500.0
    disk_prior_latency_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 0.2
    remote_prior_mb_s: Annotated[float, msgspec.Meta(gt=0.0)] = 100.0
    remote_prior_latency_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    # The handoff tier (disaggregated serving, docs/disaggregation.md): a directory shared
    # by the workers of one host (under /dev/shm: memory) that prefill workers write their
    # computed blocks to ("through") and decode workers restore from ("off": read only).
    # The worker pool sets these for its workers; "" = off.
    peer_path: str = ""
    peer_bytes: Annotated[int, msgspec.Meta(ge=0)] = 4096 * MiB
    peer_write: TierWrite = "off"
    peer_prior_mb_s: Annotated[float, msgspec.Meta(gt=0.0)] = 2000.0
    peer_prior_latency_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 0.05
    # Prefill cost per token before the step-cost model has seen a prefill.
    recompute_prior_ms_per_token: Annotated[float, msgspec.Meta(gt=0.0)] = 0.5
    # Writes queued for a slow tier beyond this are dropped (counted), never waited for.
    max_queued_write_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * MiB

    def __post_init__(self) -> None:
        super().__post_init__()
        from tokenloom.actors.kv.tiers.planner import parse_mode
        try:
            parse_mode(self.planner)
        except ValueError as e:
            raise ConfigError(f"kv_tiers.planner: {e}", key="kv_tiers.planner") from None
        if self.remote_url and not self.remote_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ConfigError("kv_tiers.remote_url must be a redis://host:port[/db], "
                              f"rediss:// or unix:// URL, got {self.remote_url!r}",
                              key="kv_tiers.remote_url")
        if self.remote_shaping and (len(self.remote_shaping) != 2 or self.remote_shaping[0] < 0
                                    or self.remote_shaping[1] <= 0):
            raise ConfigError("kv_tiers.remote_shaping must be [latency_ms >= 0, MB/s > 0] or "
                              f"empty, got {self.remote_shaping!r}",
                              key="kv_tiers.remote_shaping")
        if self.enabled and not (self.host_bytes or self.disk_path or self.remote_url
                                 or self.peer_path):
            raise ConfigError("kv_tiers.enabled needs at least one tier: host_bytes > 0, a "
                              "disk_path, a remote_url or a peer_path", key="kv_tiers.enabled")


class WorkersConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Engine worker processes behind the HTTP front (`tokenloom serve --workers N`; see
    daemon/workers/). 1 keeps the single in-process engine."""

    section: ClassVar[str] = "workers"

    # Worker processes: on CUDA one per GPU (worker i on cuda:i); on CPU each gets its share
    # of model.num_threads (or of the host's cores when that is 0).
    count: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # Which worker a request goes to: "prefix" scores expected prefix-cache overlap against
    # load, "round_robin" takes turns, "least_load" ignores prefixes
    # (docs/workers-and-routing.md).
    routing: Literal["prefix", "round_robin", "least_load"] = "prefix"
    # Prefix routing's price of one decoding request, in prefill blocks (the alpha of
    # cost = blocks to prefill + alpha * decode load).
    decode_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1000.0)] = 1.0
    # Routed prompts count as held by their worker for this long before its KV events
    # confirm them (and for good when a worker publishes none, e.g. no prefix caching).
    routed_prefix_ttl_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] = 120.0
    # A worker that dies is restarted after this, doubling on each crash within a minute.
    restart_backoff_seconds: Annotated[float, msgspec.Meta(ge=0.0, le=600.0)] = 1.0
    # A worker must load its model and warm up within this, or start-up fails.
    start_timeout_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 600.0
    # Disaggregated serving (docs/disaggregation.md): the first `prefill` workers prefill
    # the prompts handed off to the others ("decode" workers). 0 = no handoffs.
    prefill: Annotated[int, msgspec.Meta(ge=0, le=63)] = 0
    # Per request: "cost" places prompts shorter than min_remote_prefill_tokens on decode
    # workers and chooses for longer ones by predicted cost between the whole request on
    # its best worker (any role) and a prefill on a prefill worker handed off to a decode
    # worker;
    # "always" hands off every prompt of at least min_remote_prefill_tokens uncached tokens
    # (prefill workers do nothing else); "never" serves whole requests on every worker.
    disaggregation: Literal["cost", "always", "never"] = "cost"
    # Prompts with fewer uncached tokens than this always prefill where they decode.
    min_remote_prefill_tokens: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] = 256
    # The handoff tier's directory ("" = a fresh one under /dev/shm, else under the
    # temp dir) and budget.
    handoff_dir: str = ""
    handoff_bytes: Annotated[int, msgspec.Meta(ge=1 * MiB)] = 4096 * MiB
    # A finished prefill's blocks stay claimable this long; then they are deleted and a
    # decode worker that had not read them recomputes.
    handoff_lease_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    # The cost model's transfer bandwidth before the first handoff is measured.
    handoff_prior_mb_s: Annotated[float, msgspec.Meta(gt=0.0)] = 2000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill and self.prefill >= self.count:
            raise ConfigError(f"workers.prefill must leave at least one decode worker: got "
                              f"{self.prefill} with workers.count = {self.count} (allowed "
                              f"0..{self.count - 1})", key="workers.prefill")


class KVTransferConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """KV handoffs between daemons (docs/disaggregation.md): llm-d's prefill/decode protocol.
    A request with `kv_transfer_params.do_remote_decode` is prefilled and its KV kept under a
    lease for a decode daemon to pull over TCP from `port`; one with `do_remote_prefill`
    pulls the named blocks from `remote_host:remote_port` before it runs. 0 = off."""

    section: ClassVar[str] = "kv_transfer"

    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    # The address the KV server binds ("" = server.host) and the one announced to decode
    # daemons in kv_transfer_params.remote_host ("" = the bound one).
    host: str = ""
    advertise_host: str = ""
    # "prefill" (every computed block goes to the handoff tier), "decode" (read only) or
    # "both": the llm-d.ai/role of this daemon.
    role: Literal["prefill", "decode", "both"] = "both"
    lease_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    dir: str = ""              # the handoff tier ("" = a fresh one in /dev/shm or the temp dir)
    bytes: Annotated[int, msgspec.Meta(ge=1 * MiB)] = 4096 * MiB
    # A pull that has not finished within this falls back to a local prefill.
    timeout_ms: Annotated[float, msgspec.Meta(gt=0.0, le=600_000.0)] = 10_000.0


class LoRAConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Multi-LoRA serving (docs/lora.md): PEFT adapters over the base model, picked per
    request by the `model` field, several adapters in one batch. Off unless enabled or
    `modules` names adapters (as vLLM's --enable-lora / --lora-modules)."""

    section: ClassVar[str] = "lora"

    enable: bool = False
    # Adapters served from start-up: name -> PEFT directory (`serve --lora-modules name=path`).
    modules: dict[str, str] = {}
    # Adapters resident on the device at once (slots; one step may mix them all). Device
    # memory is reserved for every slot at the largest rank.
    max_loras: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    # Largest adapter rank accepted; slots are sized for it.
    max_lora_rank: Annotated[int, msgspec.Meta(ge=1, le=512)] = 16
    # Adapters kept parsed in host memory (an LRU); one evicted from it is read from disk.
    max_cpu_loras: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: 404, as in vLLM.
    allow_runtime_updates: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"lora.max_cpu_loras must be >= lora.max_loras "
                              f"({self.max_loras}), got {self.max_cpu_loras}",
                              key="lora.max_cpu_loras")
        for name, path in self.modules.items():
            if not _ADAPTER_NAME.fullmatch(name):
                raise ConfigError(f"lora.modules: adapter name {name!r} must be 1-128 letters, "
                                  "digits, '.', '_', '-' or '/'", key="lora.modules")
            if not path:
                raise ConfigError(f"lora.modules: adapter {name!r} needs a directory",
                                  key="lora.modules")

    @property
    def enabled(self) -> bool:
        return self.enable or bool(self.modules)


_ADAPTER_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")


def valid_adapter_name(name: str) -> bool:
    return bool(_ADAPTER_NAME.fullmatch(name))


DEFAULT_ADMIN_SOCKET = "/run/tokenloom/admin.sock"


class AdminConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The admin channel: newline-delimited JSON commands on a UNIX socket (see
    `tokenloom.daemon.admin.server`), separate from the public HTTP API."""

    section: ClassVar[str] = "admin"

    enabled: bool = True
    # Under systemd's RuntimeDirectory=tokenloom. At this default path a missing or
    # unwritable directory only logs a warning (unprivileged `make serve`); any other
    # path that cannot be bound fails start-up.
    socket_path: Annotated[str, msgspec.Meta(min_length=1)] = DEFAULT_ADMIN_SOCKET
    # Peers (SO_PEERCRED) allowed to send commands: their uid in allowed_uids, or their
    # gid (primary or supplementary) in allowed_gids. [] uids = the daemon's own uid and root.
    allowed_uids: list[int] = []
    allowed_gids: list[int] = []
    # A peer that sends no complete command line for this long gets an error and is closed.
    read_timeout_seconds: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 10.0
    # Longer command lines get an error and the connection is closed.
    max_line_bytes: Annotated[int, msgspec.Meta(ge=256, le=16 * MiB)] = 65536

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("allowed_uids", "allowed_gids"):
            ids = getattr(self, name)
            bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)
                   or not 0 <= i < 2**32 - 1]
            if bad:
                raise ConfigError(f"admin.{name} must be integers in 0..4294967294, got "
                                  f"{bad!r}", key=f"admin.{name}")


class RecordConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Recording live traffic as a capture for `tokenloom replay` / `tokenloom diagnose`
    (docs/debugging.md); also started and stopped at run time by `tokenloom admin record`."""

    section: ClassVar[str] = "record"

    # Record from start-up into `path` (off by default; costs nothing while off).
    enabled: bool = False
    path: str = ""
    # What is kept of each prompt: "body" (the request body), "tokens" (its token ids),
    # "hashes" (per-block chain hashes and the length only: no text leaves the host).
    content: Literal["body", "tokens", "hashes"] = "body"
    # The capture stops growing past this size; later requests are counted as dropped.
    max_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 256 * MiB

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.enabled and not self.path:
            raise ConfigError("record.path must name the capture file when record.enabled "
                              "is true", key="record.path")


class EngineConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole tree; sections default to their own defaults."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    server: ServerConfig = ServerConfig()
    graphs: GraphsConfig = GraphsConfig()
    admin: AdminConfig = AdminConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    kv_tiers: KVTiersConfig = KVTiersConfig()
    workers: WorkersConfig = WorkersConfig()
    record: RecordConfig = RecordConfig()
    lora: LoRAConfig = LoRAConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.server.embeddings and self.workers.count > 1:
            # The runner hands pooled hidden states to the in-process stream registry; the
            # worker wire does not carry them.
            raise ConfigError("server.embeddings needs workers.count = 1 (embeddings are "
                              "served by the in-process engine)", key="server.embeddings")


def resolve_cache_dir(
    cfg: ModelConfig | EngineConfig, env: Mapping[str, str] = os.environ
) -> pathlib.Path:
    """The directory for converted weights: `cache_dir` if set (with `~` expanded),
    else `$XDG_CACHE_HOME/tokenloom`, else `~/.cache/tokenloom`. Nothing is created."""
    model = cfg.model if isinstance(cfg, EngineConfig) else cfg
    if model.cache_dir:
        return pathlib.Path(model.cache_dir).expanduser()
    # The XDG spec says an empty XDG_CACHE_HOME counts as unset.
    xdg = env.get("XDG_CACHE_HOME", "")
    base = pathlib.Path(xdg) if xdg else pathlib.Path("~/.cache").expanduser()
    return base / "tokenloom"
