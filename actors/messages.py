"""Every message that crosses an actor boundary, as compact msgspec Structs.

Structs (not Python objects with behaviour) so that any boundary could become a process
boundary later: each one is encodable with msgspec.msgpack. Actors dispatch with `match`.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tokenloom.actors.kv.groups import KVGroups
from tokenloom.actors.kv.kv_manager import TableGrowth
from tokenloom.actors.kv.prefix_cache import PrefixCacheStats, PrefixQuery
from tokenloom.actors.kv.tiers.stats import TiersStats
from tokenloom.actors.metric_fields import counter, gauge
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.kernels.models.model_spec import ModelSpec


class _Msg(msgspec.Struct, kw_only=True, gc=False):
    pass


# -- what a request is, apart from its prompt and sampling: carried whole -------------------
class RequestMeta(_Msg, frozen=True):
    """Who a request is for and how it is to be treated, set once by whoever submits it (the
    HTTP layer parses it from the body and headers, daemon/openai/protocol.py) and carried
    whole to the scheduler's Request: no layer copies its fields one by one. It is in the
    request's trace as it came."""
    cache_salt: str | None = None   # prefix-cache isolation: different salts never share KV
    # Scheduling: lower `priority` runs first (vLLM's convention; the HTTP layer maps class
    # names such as "interactive" / "batch" to numbers); `tenant` is the fair-share key.
    priority: int = 0
    tenant: str | None = None
    # With worker processes: requests with the same key stay on one worker when costs tie
    # (prompt_cache_key, X-Session-Id or the tenant; actors/front/routing.py).
    affinity: str | None = None
    # n > 1: the request id of sibling 0. A sibling waits until that one's prompt is
    # computed, then reuses its full prompt blocks from the prefix cache (fan_out sets it).
    group_id: str | None = None
    # The client's own labels (OpenAI's `metadata`: up to 16 string pairs), kept in the
    # trace so that a cohort of requests can be found and compared by them.
    labels: dict[str, str] | None = None
    # The LoRA adapter it runs with (the `model` field named one); None: the base model. Part
    # of its prefix-cache identity: two adapters never share KV.
    lora: str | None = None
    # Disaggregated serving: this is the prefill half of a request whose decode runs on
    # another worker; every prompt block it holds (computed or cached) is written to the
    # handoff KV tier (actors/kv/tiers/handoff.py). Set by the worker pool, never by a client.
    kv_export: bool = False


# -- measured at start-up: the engine's facts, for the front and the worker wire ------------
class RuntimeInfo(_Msg, frozen=True):
    """Values measured or derived at start-up (config stays as the user wrote it). Plain
    values only, so that a worker process sends its own in its Hello unchanged."""
    model_dir: str
    spec: ModelSpec
    device: str                     # torch device string, e.g. "cpu", "cuda:0"
    dtype: str                      # torch dtype name, e.g. "float32"
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    attention_backend: str = "torch"
    weights_digest: str = ""
    fingerprint: str = ""           # the prefix-cache identity's model part (block hashes)
    eos_token_ids: tuple[int, ...] = ()
    # How K/V are stored: "auto" (= dtype) or a 1-byte format per side, e.g. "int8" or
    # "fp8_e4m3/int8" (K/V); kv_bytes_per_token then counts the 1-byte values and scales.
    kv_dtype: str = "auto"
    kv_rotation: str = "none"       # "hadamard": q/k/v rotated before the quantized cache
    # How the layers share the KV pool (actors/kv/groups.py); None: one group, a block
    # holding every layer (kv_bytes_per_token then is a block's bytes per token).
    kv_groups: KVGroups | None = None

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def torch_device(self):
        import torch
        return torch.device(self.device)

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)


# -- front end -> tokenizer -> scheduler ------------------------------------------------
class GenerateRequest(_Msg):
    """A request as a client gave it: text, token ids, or chat messages (exactly one)."""
    request_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    # Chat tools for a template that renders them (OpenAI's shape); None otherwise.
    tools: list[dict] | None = None
    arrival_time: float = 0.0
    # True when the client left max_tokens unset: the tokenizer lowers max_tokens (and
    # min_tokens) to whatever the context window leaves after the prompt.
    fit_max_tokens: bool = False
    meta: RequestMeta = msgspec.field(default_factory=RequestMeta)
    # Extra variables for the chat template (vLLM's chat_template_kwargs), e.g. Qwen3's
    # {"enable_thinking": false}; None: none.
    chat_template_kwargs: dict[str, Any] | None = None


class AddRequest(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    meta: RequestMeta = msgspec.field(default_factory=RequestMeta)
    tokenized_time: float | None = None   # when the tokenizer finished it (for the trace)
    routed_time: float | None = None   # when the router forwarded it (for the trace)


class AbortRequest(_Msg):
    request_id: str


# -- scheduler/tokenizer -> router (via the engine's emit) -------------------------------
class RequestFinished(_Msg):
    """A request the router forwarded has ended (any reason); it no longer counts as queued."""
    request_id: str


# -- scheduler -> stream registry --------------------------------------------------------
class TokenLogprob(_Msg):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None
    rank: int | None = None   # prompt logprobs: 1 + how many tokens were more likely


class RequestTimings(_Msg):
    """Monotonic-clock seconds; the per-request metrics are derived from these."""
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = []
    num_preemptions: int = 0
    # Prefix cache, from the request's first admission: prompt tokens whose KV was reused
    # (full blocks only), how many blocks hit, and why the first miss happened.
    num_cached_tokens: int = 0
    prefix_hit_blocks: int = 0
    prefix_miss_reason: str | None = None
    # KV tiers: num_cached_tokens split by where the KV came from ("device", "host", ...).
    cached_tokens_by_tier: dict[str, int] | None = None
    trace: dict | None = None   # the request's trace (see actors/scheduling/trace.py), JSON-ready


# What kind of failure a finished-with-error output reports; the HTTP layer maps it to a status.
ERROR_INVALID = "invalid_request"   # the request itself is bad (400)
ERROR_OVERLOADED = "overloaded"     # the waiting queue is full (429, retry later)
ERROR_INTERNAL = "internal"         # the engine failed or shut down (500/503)


class RequestOutput(_Msg):
    """One engine request's progress: new tokens and the text they completed (incremental
    detokenization and stop strings run inside the engine, see output_processor.py)."""
    request_id: str
    new_token_ids: list[int]
    text: str = ""                         # the new, final text (stop strings never leak)
    new_logprobs: list[TokenLogprob] | None = None
    # SamplingParams.prompt_logprobs: on the output that carries the first token, one entry
    # per prompt token (the first None: nothing precedes it) and the prompt's token ids.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    # On the router's acknowledgement: max_tokens as admitted (the tokenizer actor lowered
    # it to what the context window leaves when the request asked it to).
    max_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"
    error: str | None = None
    error_kind: str | None = None          # ERROR_* when finish_reason is "error"
    error_param: str | None = None         # the request field at fault, if one is
    timings: RequestTimings | None = None  # sent with the final output


# -- scheduler <-> KV manager ------------------------------------------------------------
class KVCommit(_Msg):
    """A request's computed full blocks, offered to the prefix cache (chain-hashed)."""
    request_id: str
    num_computed_tokens: int
    block_hashes: list[bytes]
    token_ids: list[int]
    content_hashes: list[bytes] | None = None
    # Announced with the chain's first block (KV events' extra_keys, as vLLM does), so an
    # external index keys salted blocks apart.
    cache_salt: str | None = None
    # KV events' lora_name: an external index keys each adapter's blocks apart.
    lora_name: str | None = None


class KVAdmission(_Msg):
    """A waiting request the policy admits with `planned_tokens` computed from scratch;
    the KV manager may start it from its cached prefix within the same reservation."""
    request_id: str
    planned_tokens: int
    query: PrefixQuery


class TierQuery(_Msg):
    """A new request's chain, looked up in the KV tiers before it may be admitted:
    `recompute` is the engine's prefill cost at the current load (the planner weighs a
    restore against it)."""
    request_id: str
    query: PrefixQuery
    recompute: Any


class TierReady(_Msg):
    """KV manager -> scheduler: a held request's tier fetch has ended (its restore, if
    any, is staged for its admission). `report`: actors/kv/tiers/manager.TierReport."""
    request_id: str
    report: Any


class KVUpdate(_Msg):
    """One iteration's KV work, applied in order: `commits`, `swap_outs` (the tables to copy
    to host slots, resolved before they are freed), `frees`, `forks`, the running `grants`
    (grow each table to hold its token count, atomically), each of `admissions`, then
    `swap_ins` (host slots copied into the tables just granted). The reply reports the
    tables of `tables_for` and the held/exclusive block counts of `report`."""
    frees: list[str]
    grants: list[tuple[str, int]]
    commits: list[KVCommit] = []
    admissions: list[KVAdmission] = []
    report: list[str] = []
    tables_for: list[str] = []
    # n > 1: (sibling 0, sibling, tokens) — share its full blocks, copy its partial one.
    forks: list[tuple[str, str, int]] = []
    swap_outs: list[tuple[str, list[int]]] = []   # (request, host slots in table order)
    swap_ins: list[tuple[str, list[int]]] = []    # (request, host slots in table order)
    # KV tiers (actors/kv/tiers): new arrivals' chains to look up below the device pool
    # (first, before the grants), and requests that ended before admission (their staged
    # restores are dropped).
    tier_queries: list[TierQuery] = []
    tier_cancels: list[str] = []
    # Sliding-window layer groups (actors/kv/groups.py): each running request's next
    # position to compute, behind which its sliding groups drop their blocks (after the
    # frees, before the grants); also where a swapped-in request's new tables start.
    computed: dict[str, int] = {}


class KVGrant(_Msg):
    """The KV manager's answer, and the scheduler's whole view of the pool until the next
    one: nothing in it is kept up to date by hand on the scheduler's side."""
    new_blocks: dict[str, list[int]] | None  # None: refused, nothing was allocated
    num_free_blocks: int
    num_used_blocks: int
    freed: int
    admitted: dict[str, TableGrowth] = {}
    held: dict[str, int] = {}                # report: blocks in each table
    exclusive: dict[str, int] = {}           # report: blocks each would free if released
    logical: dict[str, int] = {}             # report: each one's tables' length in blocks
                                             # (several layer groups only)
    tables: dict[str, list[int]] = {}        # tables_for: the block tables for the runner
    group_tables: dict[str, list[list[int]]] = {}   # ... of layer groups 1.. (if several)
    forked: dict[str, list[int]] = {}        # child -> its new table
    # Children whose sibling 0 no longer holds what they would read (a sliding window
    # moved on): they are admitted like any request instead.
    unforkable: list[str] = []
    copies: list[tuple[int, int]] = []       # (src, dst) blocks the runner must copy first
    swap_out: list[tuple[int, int]] = []     # (device block, host slot)
    swap_in: list[tuple[int, int]] = []      # (host slot, device block)
    failed: dict[str, str] = {}              # grants that could not be allocated: the error
    # KV tiers: queried requests that wait for a fetch (a TierReady comes for each), the
    # rest may be admitted at once; device blocks to copy out (block, BlockMeta,
    # committed) before anything overwrites them, and the restores of this grant's
    # admissions (in `admitted[...].restores`).
    tier_held: list[str] = []
    tier_ready: list[Any] = []               # TierReports of the queried, not held, ones
    tier_plans: dict[str, dict] = {}         # admissions' restore plans made at admission
    offloads: list[tuple[int, Any, bool]] = []


# -- scheduler <-> runner ----------------------------------------------------------------
class NewSequence(_Msg):
    """Sent the first time a request is scheduled (and again after a preemption)."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams


# In a ScheduledSequence's token_ids: "the token this request sampled in the previous step",
# which the scheduler has not seen yet when steps overlap. The runner substitutes it.
PLACEHOLDER = -1


class ScheduledSequence(_Msg):
    request_id: str
    token_ids: list[int]       # tokens to compute this step (1 for a decode; may be PLACEHOLDER)
    start_pos: int             # position of token_ids[0]
    block_table: list[int]     # blocks covering positions [0, start_pos + len(token_ids))
    sample: bool               # this step completes the sequence's known tokens: sample one
    new: NewSequence | None = None
    # Speculative decoding: the last `num_draft` of token_ids are proposals to verify (the
    # step samples 1..num_draft + 1 tokens); `propose`: after sampling, propose this many
    # tokens for the next step (SpecResult.proposals).
    num_draft: int = 0
    propose: int = 0
    # The scheduler still lacks some of this request's prompt logprobs: the runner returns
    # those of the prompt tokens after this chunk's positions (StepOutput.prompt_logprobs).
    prompt_logprobs: bool = False
    # The LoRA slot this request's rows run with (kernels/lora/stacks.py); -1: base model.
    lora_slot: int = -1
    # The block tables of layer groups 1.. (actors/kv/groups.py; `block_table` is group
    # 0's), NULL_BLOCK behind a sliding group's window; None: the model has one group.
    group_tables: list[list[int]] | None = None


class ExecuteBatch(_Msg):
    step: int
    sequences: list[ScheduledSequence]   # decodes first, then prefill chunks
    num_decodes: int
    finished_ids: list[str] = []         # runner may drop their per-request state
    # Applied in this order, before the forward: the fork copies (decided first), then swap
    # preemption's copies out and in. A batch may carry only these (no sequences).
    block_copies: list[tuple[int, int]] = []  # (src, dst): copy-on-write of forked siblings
    swap_out: list[tuple[int, int]] = []      # (device block, host slot)
    swap_in: list[tuple[int, int]] = []       # (host slot, device block)
    # KV tiers: blocks copied out to the tiers FIRST (before the copies above may
    # overwrite an evicted block), and restored blocks written in LAST (after the swaps).
    kv_offloads: list[tuple[int, Any, bool]] = []    # (device block, BlockMeta, committed)
    kv_restores: list[tuple[int, Any]] = []          # (device block, its bytes)
    # LoRA: (slot, adapter name, directory) to load into the device slots before the
    # forward (actors/scheduling/lora_slots.py decided them; the runner reads or reuses them).
    lora_loads: list[tuple[int, str, str]] = []


class SampledToken(_Msg):
    request_id: str
    token_id: int
    logprob: TokenLogprob | None = None
    # Set when the request cannot go on (its output constraint leaves no legal token): the
    # scheduler ends it with this error and drops token_id.
    error: str | None = None


class PooledOutput(_Msg):
    """runner -> the request's stream (SamplingParams.pooling): the final-normed hidden state
    pooled over the request's prompt, sent before the request's finished output. Not
    normalized: the caller normalizes (or not) as the model's pooling config says."""
    request_id: str
    data: list[float]
    error: str | None = None   # set instead of data when the request cannot be pooled


class PromptLogprobs(_Msg):
    """One prefill chunk's prompt logprobs: `logprobs[i]` is prompt token start + 1 + i's,
    from the logits at position start + i (a chunk's last position gives the next chunk's
    first token; the prompt's last position gives none)."""
    request_id: str
    start: int
    logprobs: list[TokenLogprob]


class SpecResult(_Msg):
    """A sequence's speculation in one step: how many of its `num_draft` proposals the
    target accepted (its SampledTokens are those, then one more), and the proposals for
    its next step."""
    request_id: str
    num_draft: int = 0
    num_accepted: int = 0
    proposals: list[int] = []


class StepOutput(_Msg):
    step: int
    sampled: list[SampledToken]
    compute_seconds: float
    error: str | None = None             # the whole step failed; message for the requests
    swap_seconds: float = 0.0            # time spent on swap_out + swap_in copies
    # How long the compute thread waited for this batch after finishing the previous one
    # (host work the device was exposed to; with overlapped steps, near 0).
    idle_seconds: float = 0.0
    spec: list[SpecResult] = []          # speculative sequences' verification and proposals
    draft_seconds: float = 0.0           # time the draft model took (method "draft")
    prompt_logprobs: list[PromptLogprobs] = []   # chunks that asked for them (in batch order)


class ForgetRequests(_Msg):
    """scheduler -> runner, when the engine goes idle: these requests finished since the
    last batch (whose finished_ids would have carried them); drop their sampling state."""
    request_ids: list[str]


class OffloadKV(_Msg):
    """scheduler -> runner, when the engine goes idle: device blocks to copy down to the KV
    tiers now (a batch would have carried them; none is coming)."""
    offloads: list[tuple[int, Any, bool]]


class Shutdown(_Msg):
    pass


# -- control: typed queries to one actor (tests, admin, /metrics) ------------------------
# Each carries `reply`, an asyncio.Future (in-process only) that the actor resolves with the
# typed answer named in the docstring. Actors match on the type.
class _Query(_Msg, kw_only=True):
    reply: Any = None


class GetSchedulerStats(_Query):
    """-> SchedulerStats"""


class IsIdle(_Query):
    """-> bool: nothing waiting, running or in flight"""


class GetTrace(_Query):
    """-> list[dict]: the traces of request_id (or of its choices)"""
    request_id: str


class GetKVStats(_Query):
    """-> KVStats"""


class SetLoRAAdapter(_Query):
    """-> bool (whether it was known): add an adapter (`path` its checked directory) to
    the scheduler's registry, or remove it (`path` None): waiting requests of a removed one
    fail, running ones finish on their slot."""
    name: str
    path: str | None = None


class CheckIntegrity(_Query):
    """-> str | None: what is wrong with the block pool, None when it is sound"""


class FlushPrefixCache(_Query):
    """-> FlushResult"""
    force: bool = False


class SubscribeKVEvents(_Query):
    """-> None; callback(KVEventBatch) runs on the engine's loop for every batch"""
    callback: Any = None


class GetRouterStats(_Query):
    """-> RouterStats"""


class GetRunnerState(_Query):
    """-> RunnerState"""


class GetGraphStats(_Query):
    """-> GraphStats"""


G, C = gauge, counter   # (Prometheus kinds of the annotated fields below: metric_fields.py)
STEP_DOC = ("Mean engine step time by part over the last steps: forward (the runner), host "
            "(planning, KV round trip, output processing), exposed_host (host time the runner "
            "waited for).")


class StepTimings(_Msg, frozen=True):
    """Where an engine step's time goes, as means over the last window of steps (ms).
    `forward_ms` is the runner's execute time; `host_ms` the scheduler's planning, KV
    round trip and output processing; `exposed_host_ms` the part of host_ms the runner
    waited for (with overlapped steps most of host_ms runs while the runner computes)."""
    steps: int = 0
    forward_ms: Annotated[float, G("tokenloom:step_time_ms", STEP_DOC, "part", "forward")] = 0.0
    host_ms: Annotated[float, G("tokenloom:step_time_ms", STEP_DOC, "part", "host")] = 0.0
    exposed_host_ms: Annotated[float, G("tokenloom:step_time_ms", STEP_DOC, "part",
                                        "exposed_host")] = 0.0
    kv_round_trip_ms: Annotated[float, G("tokenloom:step_time_ms", STEP_DOC, "part",
                                         "kv_round_trip")] = 0.0
    batch_size: float = 0.0


class SpecStats(_Msg):
    """Speculative decoding since start-up (vLLM's spec_decode counters): verification
    steps (one per speculating sequence per step), draft tokens verified and accepted,
    accepted count per draft position, and steps where the kill switch stopped the batch."""
    method: str
    num_speculative_tokens: int
    num_drafts: Annotated[int, C("vllm:spec_decode_num_drafts", "Verification steps: one per "
                                 "speculating sequence per step.")] = 0
    num_draft_tokens: Annotated[int, C("vllm:spec_decode_num_draft_tokens",
                                       "Draft tokens verified.")] = 0
    num_accepted_tokens: Annotated[int, C("vllm:spec_decode_num_accepted_tokens",
                                          "Draft tokens accepted.")] = 0
    accepted_per_position: Annotated[list[int], C(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Accepted draft tokens by position in the draft.", "position")] = []
    steps_killed: Annotated[int, C("tokenloom:spec_decode_steps_killed", "Steps where "
                                   "speculation would not pay for the batch (kill switch).")] = 0


class LoRAStats(_Msg):
    """Multi-LoRA serving (when [lora] is on): vllm:lora_requests_info is built from it."""
    max_loras: int
    registered: list[str]                  # adapters a request may name
    resident: list[str | None]             # what each device slot holds
    running: list[str]                     # adapters of running requests
    waiting: list[str]                     # adapters of waiting requests
    num_loads: Annotated[int, C("tokenloom:lora_loads", "Adapters loaded into a device "
                                "slot.")]
    num_evictions: Annotated[int, C("tokenloom:lora_evictions", "Adapters evicted from a "
                                    "device slot to make room for another.")]
    num_slot_waits: Annotated[int, C("tokenloom:lora_slot_waits", "Times a waiting request "
                                     "was left out of a step because no adapter slot was "
                                     "free.")]
    requests_by_adapter: dict[str, int] = {}   # admitted requests per adapter (cumulative)


class SchedulerStats(_Msg):
    waiting: Annotated[int, G("vllm:num_requests_waiting",
                              "Number of requests waiting to be processed.")]
    running: Annotated[int, G("vllm:num_requests_running",
                              "Number of requests in model execution batches.")]
    in_flight_steps: int
    overlap: bool
    num_steps: Annotated[int, C("tokenloom:engine_steps",
                                "Engine iterations (batches) executed.")]
    num_forks: Annotated[int, C("tokenloom:sibling_forks", "n > 1 siblings started from "
                                "their sibling 0's prompt blocks (copy-on-write forks).")]
    num_preemptions: Annotated[int, C("vllm:num_preemptions",
                                      "Cumulative number of preemptions.")]
    num_swap_preemptions: int
    num_free_blocks: int
    max_decode_skip: Annotated[int, G("tokenloom:max_decode_skip", "Most consecutive "
                                      "iterations any running decode was left out (invariant: "
                                      "<= scheduler.max_decode_skip).")]
    admission_paused: Annotated[bool, G("tokenloom:admission_paused", "1 while admission "
                                        "waits for the KV resume watermark after a "
                                        "preemption.")]
    prefill_budget: int | None
    cost_model: list[float] | None
    swap_free_slots: int | None
    num_slo_evaluated: Annotated[int, C("tokenloom:slo_evaluated_requests", "Finished "
                                        "requests checked against the TTFT and ITL "
                                        "objectives.")]
    num_slo_good: Annotated[int, C("tokenloom:goodput_requests", "Finished requests within "
                                   "the TTFT and ITL objectives.")]
    num_kv_plan_waits: Annotated[int, C("tokenloom:kv_plan_waits", "Iterations in which the "
                                        "first waiting request was held back by the KV plan "
                                        "(pool pressure).")] = 0
    timings: StepTimings = StepTimings()
    spec: SpecStats | None = None
    lora: LoRAStats | None = None


class KVStats(_Msg):
    num_blocks: Annotated[int, G("tokenloom:kv_blocks_total", "KV-cache blocks in the pool.")]
    free: Annotated[int, G("tokenloom:kv_blocks_free", "KV-cache blocks free.")]
    used: int
    usage: Annotated[float, G("vllm:kv_cache_usage_perc",
                              "KV-cache usage. 1 means 100 percent usage.")]
    block_size: int
    cached_blocks: Annotated[int, G("tokenloom:prefix_cache_blocks",
                                    "KV blocks holding a cached prefix.")]
    prefix_cache: PrefixCacheStats
    tiers: TiersStats | None = None   # when [kv_tiers] is on


class RouterStats(_Msg):
    in_flight: Annotated[int, G("tokenloom:requests_in_flight",
                                "Requests admitted by the router and not yet finished.")]
    capacity: int
    num_rejected: Annotated[int, C("tokenloom:requests_rejected_overload", "Requests refused "
                                   "with 429 because the waiting queue was full.")]


class GraphStats(_Msg):
    """How steps ran (graphs/dispatch.py decides; the runner counts replays where they
    happen): decode-graph, piecewise and eager steps (eager with reasons), padding, the
    decode batch-size histogram graphs.histogram_path reads, capture time and memory."""
    graphs: bool = False                       # decode graphs (or CPU programs) captured
    capture_sizes: list[int] = []
    graph_steps: Annotated[int, C("tokenloom:graph_steps",
                                  "Decode steps that replayed a CUDA graph.")] = 0
    eager_steps: int = 0
    eager_reasons: Annotated[dict[str, int], C("tokenloom:eager_steps",
                                               "Steps run eagerly, by reason.", "reason")] = {}
    graph_real_rows: int = 0
    graph_padded_rows: Annotated[int, C("tokenloom:graph_padding_rows", "Padding rows computed "
                                        "by graph replays (bucket size minus batch size).")] = 0
    padding_waste_fraction: Annotated[float, G("tokenloom:graph_padding_waste_ratio",
                                               "Padding rows / all rows of graph replays.")] = 0.0
    piecewise: bool = False
    piecewise_token_sizes: list[int] = []
    piecewise_steps: Annotated[int, C("tokenloom:piecewise_steps", "Steps with prefill tokens "
                                      "that replayed piecewise CUDA graphs (everything but "
                                      "attention).")] = 0
    piecewise_real_tokens: int = 0
    piecewise_padded_tokens: Annotated[int, C("tokenloom:piecewise_padding_tokens", "Padding "
                                              "tokens computed by piecewise replays (token "
                                              "bucket minus step tokens).")] = 0
    piecewise_padding_waste_fraction: float = 0.0
    # Save this as graphs.histogram_path to derive buckets from real traffic.
    decode_batch_size_histogram: Annotated[dict[str, int], C(
        "tokenloom:decode_batch_size", "Decode-only steps by batch size (the histogram "
        "graphs.histogram_path wants).", "size")] = {}
    captured_sizes: list[int] = []
    capture_seconds: float = 0.0
    capture_bytes: int = 0
    replays: Annotated[int, C("tokenloom:graph_replays",
                              "CUDA graph replays (counted at replay).")] = 0
    static_eager_runs: int = 0
    piecewise_captured_sizes: list[int] = []
    piecewise_capture_seconds: float = 0.0
    piecewise_capture_bytes: int = 0
    piecewise_replays: Annotated[int, C("tokenloom:piecewise_replays", "Piecewise graph "
                                        "replays (counted at replay; one per step).")] = 0
    piecewise_static_eager_runs: int = 0


class RunnerState(_Msg):
    num_tracked: int
    graphs: GraphStats = msgspec.field(default_factory=GraphStats)


class KVQuantStats(_Msg):
    """How the KV cache is stored and what its runtime quality check saw
    (kernels/kv_quality_check.py; docs/kv-quantization.md)."""
    kv_dtype: str = "auto"
    rotation: str = "none"
    bytes_per_token: Annotated[int, G("tokenloom:kv_cache_bytes_per_token",
                                      "KV cache bytes per token (every layer's K and V, "
                                      "with the scales of a quantized cache).")] = 0
    check_fraction: float = 0.0
    check_steps: Annotated[int, C("tokenloom:kv_quant_check_steps",
                                  "Decode steps the runtime KV quality check compared.")] = 0
    check_layer_comparisons: int = 0
    check_alarms: Annotated[int, C("tokenloom:kv_quant_check_alarms",
                                   "Layer comparisons of the runtime KV quality check over "
                                   "budget (attention KL or K/V relative error).")] = 0
    check_max_kl: Annotated[float, G("tokenloom:kv_quant_check_max_kl",
                                     "Largest attention KL (nats) the runtime KV quality "
                                     "check measured.")] = 0.0
    check_last_kl: Annotated[float, G("tokenloom:kv_quant_check_last_kl",
                                      "The last checked step's largest layer attention KL "
                                      "(nats).")] = 0.0
    check_max_error: Annotated[float, G("tokenloom:kv_quant_check_max_error",
                                        "Largest relative error of shadowed K/V rows the "
                                        "runtime KV quality check measured.")] = 0.0
    promoted_layers: list[int] = []
    num_promoted_layers: Annotated[int, G("tokenloom:kv_quant_promoted_layers",
                                          "Layers promoted to the model dtype for new blocks "
                                          "by the runtime KV quality check.")] = 0


class LoRALoadStats(_Msg):
    """The runner's adapter loads into device slots (when [lora] is on)."""
    from_disk: Annotated[int, C("tokenloom:lora_loads_from_disk", "Adapter slot loads that "
                                "read the adapter from disk (not in the host LRU).")] = 0
    from_host: Annotated[int, C("tokenloom:lora_loads_from_host", "Adapter slot loads served "
                                "from the host LRU of parsed adapters.")] = 0
    disk_seconds: Annotated[float, C("tokenloom:lora_load_disk_seconds", "Time spent loading "
                                     "adapters from disk into slots.")] = 0.0
    host_seconds: Annotated[float, C("tokenloom:lora_load_host_seconds", "Time spent copying "
                                     "adapters from host memory into slots.")] = 0.0
    host_evictions: Annotated[int, C("tokenloom:lora_host_evictions", "Adapters dropped from "
                                     "the host LRU (lora.max_cpu_loras).")] = 0


class EngineStats(_Msg):
    """Everything admin `stats` and `/metrics` show about the engine, read in one call. The
    admin reply nests it unchanged; /metrics exports its annotated fields."""
    scheduler: SchedulerStats
    kv: KVStats
    router: RouterStats
    # The graph dispatcher's counters, as of the runner's latest snapshot (at most ~0.25 s
    # old while it works).
    graphs: GraphStats = msgspec.field(default_factory=GraphStats)
    kv_quant: KVQuantStats = msgspec.field(default_factory=KVQuantStats)
    lora_loads: LoRALoadStats | None = None


# -- worker processes: the front's router <- the worker pool (daemon/workers/) -----------
class RequestStarted(_Msg):
    """A routed request's first token arrived: its prefill is no longer queued."""
    request_id: str


class WorkerUp(_Msg):
    """Worker `worker` (re)started and serves; it holds no cached blocks yet."""
    worker: int


class WorkerDown(_Msg):
    """Worker `worker` died: its requests were ended with an error by the pool."""
    worker: int


class WorkerReport(_Msg):
    """A worker's KV pool as it last reported it."""
    worker: int
    free_blocks: int
    kv_usage: float
    lora_adapters: list[str] | None = None   # the LoRA adapters in its device slots


class RehomeRequest(_Msg):
    """Disaggregation: route this request again, to a decode worker other than
    `exclude` (its decode worker died before producing a token; its KV is in the handoff
    tier), prefilling there whatever the handoff tier does not hold."""
    request: AddRequest
    exclude: int


class HandoffMeasured(_Msg):
    """What a finished request measured for the disaggregation cost model: `worker`
    prefilled `prefill_tokens` in `prefill_seconds`; a decode worker restored
    `transfer_bytes` from the handoff tier in `transfer_seconds` (0: none); it decoded
    `decode_tokens` tokens after its first in `decode_seconds`."""
    worker: int
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0


class WorkerKVEvents(_Msg):
    """KV cache events (actors/kv/events.py) from worker `worker`, in emission order."""
    worker: int
    events: list[Any]


class GetRoutingStats(_Query):
    """-> RoutingStats"""


class RoutingStats(_Msg):
    """Per worker (index = worker), since start-up unless noted."""
    policy: str
    up: list[bool]
    in_flight: list[int]                 # now
    queued_prefill_blocks: list[int]     # now
    decoding: list[int]                  # now
    kv_usage: list[float]                # last report
    routed: list[int]
    prompt_blocks: list[int]
    expected_hit_blocks: list[int]
    num_rejected: int = 0                # no worker was up
    # Disaggregation (None: off): each worker's role, decisions by reason, the cost
    # model's learned rates, and the handoffs in flight (added by the worker pool).
    roles: list[str] | None = None
    disaggregation: dict | None = None


class WorkerStatus(_Msg):
    """One engine worker process as the pool supervises it (/health, admin stats)."""
    worker: int
    up: bool
    pid: int | None = None
    incarnation: int = 0
    restarts: int = 0
    last_exit_code: int | None = None
    seconds_since_exit: float | None = None
    device: str = ""
    threads: int | None = None
    kv_usage: float | None = None        # last report, while up
    draining: bool = False
    role: str = "both"                   # "prefill" | "decode" | "both" (disaggregation)


class WorkerStats(_Msg):
    """Per worker process: the pool's status, the router's account and each live worker's
    own engine stats (keyed by worker index)."""
    statuses: list[WorkerStatus]
    routing: RoutingStats
    engines: dict[int, EngineStats] = {}
