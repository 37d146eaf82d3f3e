"""A request's progress as token counts, and its lifecycle as a checked state machine.

There is no separate prefill or decode phase in the data: a request has tokens (prompt +
generated so far) and `num_computed_tokens` whose KV is in the cache. When fewer than one
token is missing it decodes; otherwise it prefills (in chunks, possibly after preemption,
where the "prompt" to recompute includes the tokens generated before).
"""

from __future__ import annotations

import enum
import time
from typing import Sequence

from tokenloom.actors.messages import RequestMeta
from tokenloom.actors.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING_PREFILL = 0
    PREFILLING = 1
    WAITING_DECODE = 2
    DECODING = 3
    PREEMPTED = 4
    FINISHED = 5
    CANCELLED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


_S = RequestStatus
# The seeds' state machine. PREFILLING may go straight to FINISHED (the first token ends it)
# or to WAITING_DECODE; a preempted request goes back to waiting and starts over.
ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING_PREFILL: frozenset({_S.PREFILLING, _S.FINISHED, _S.CANCELLED}),
    _S.PREFILLING: frozenset({_S.WAITING_DECODE, _S.FINISHED, _S.CANCELLED, _S.PREEMPTED}),
    _S.WAITING_DECODE: frozenset({_S.DECODING, _S.FINISHED, _S.CANCELLED, _S.PREEMPTED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.CANCELLED, _S.PREEMPTED}),
    _S.PREEMPTED: frozenset({_S.WAITING_PREFILL, _S.CANCELLED}),
    _S.FINISHED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


class FinishReason(enum.IntEnum):
    STOP = 0      # EOS, a stop token or a stop string
    LENGTH = 1    # max_tokens or the context window
    ABORT = 2     # cancelled by the client
    ERROR = 3     # rejected or failed; `error` says why

    def as_openai(self) -> str:
        return ("stop", "length", "abort", "error")[self]


class Request:
    """Scheduler-side state of one sequence. Owned by the scheduler actor only."""

    # Read through to the request's metadata (lower priority runs first; tenant is the
    # fair-share key; group_id, n > 1: sibling 0's id, see siblings.py).
    priority = property(lambda self: self.meta.priority)
    tenant = property(lambda self: self.meta.tenant)
    cache_salt = property(lambda self: self.meta.cache_salt)
    group_id = property(lambda self: self.meta.group_id)
    lora_name = property(lambda self: self.meta.lora)   # its LoRA adapter (None: base)

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, eos_token_ids: Sequence[int] = (),
                 arrival_time: float | None = None, max_model_len: int | None = None,
                 meta: RequestMeta = RequestMeta(), arrival_seq: int = 0):
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.status = RequestStatus.WAITING_PREFILL
        # Tokens whose KV is computed or being computed by a step in flight (the scheduler
        # advances it when it launches a step, as vLLM's async scheduling does).
        self.num_computed_tokens = 0
        # Sampled tokens of steps in flight that have not come back yet (overlapped steps:
        # at most one step is in flight while the next is planned). They count as tokens
        # for scheduling; the next step feeds them to the model as placeholders.
        self.num_placeholders = 0
        # Whether the runner holds this request's sampling state (set when a batch carries
        # its NewSequence, cleared when it is preempted or finished).
        self.on_runner = False
        # Iterations in a row it was running as a decode and left out (invariant 3).
        self.num_skipped = 0
        self.num_preemptions = 0
        # A longrope model: its KV rotates with the long factors (it was admitted longer
        # than the original window, or recomputed once it grew past it); part of its
        # prefix-cache identity. Set by the scheduler.
        self.rope_long = False
        # n > 1: its sibling 0 could not share its blocks (kv_actor: unforkable); it is
        # admitted like any request.
        self.fork_refused = False
        # Salt, priority, tenant, affinity, sibling group: as the submitter gave them
        # (messages.RequestMeta); arrival_seq breaks ties in arrival order.
        self.meta = meta
        self.arrival_seq = arrival_seq
        # The device slot of its LoRA adapter while admitted (actors/scheduling/lora_slots.py).
        self.lora_slot = -1
        # Swap preemption: host-pool slots holding this request's KV (in table order)
        # while it waits to be swapped back in; None when its KV is on the device or gone.
        self.swapped_slots: list[int] | None = None
        self.trace = None  # tokenloom.actors.scheduling.trace.RequestTrace, set by the scheduler
        # Speculative decoding: its SpecState (None: it never speculates) and the runner's
        # proposals for the token after its last known one (see actors/speculation/controller.py).
        self.spec = None
        self.draft_token_ids: list[int] = []
        # Its IncrementalDetokenizer (stop strings included), set by the output processor.
        self.detokenizer = None
        # Prefix cache: chain hashes of full blocks (extended as tokens are computed), the
        # salt-free chain when salted (to explain isolation misses), blocks committed to the
        # cache, and what the first admission found cached.
        self.block_hashes: list[bytes] = []
        self.content_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.num_cached_tokens = 0
        self.prefix_hit_blocks = 0
        self.prefix_miss_reason: str | None = None
        # KV tiers: held out of admission while its blocks are fetched from a tier; the
        # cached tokens by where they came from (device, host, disk, remote).
        self.tier_hold = False
        self.cached_tokens_by_tier: dict[str, int] | None = None
        # SamplingParams.prompt_logprobs: what the runner has returned so far (entry j is
        # prompt token j + 1's), until they go out with the first token; None: not asked.
        self.prompt_logprobs: list | None = (
            [] if sampling_params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        # Timings (time.monotonic seconds) for the per-request metrics.
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.token_times: list[float] = []

    # -- progress, derived from token counts ------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Known tokens plus those being sampled by a step in flight."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens whose KV is not yet computed (the last one is the next step's input)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Some of its prompt logprobs have not come back: its prompt must be computed (no
        prefix-cache read) and its chunks marked."""
        lps = self.prompt_logprobs
        return lps is not None and len(lps) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, start: int, logprobs: list) -> None:
        """A chunk's prompt logprobs (messages.PromptLogprobs): entry i is prompt token
        start + 1 + i's. Chunks come back in order; a chunk recomputed after a preemption
        repeats what is known, which is kept."""
        have = self.prompt_logprobs
        if have is not None and start <= len(have):
            have.extend(logprobs[len(have) - start:])

    @property
    def is_decode(self) -> bool:
        return (self.num_remaining_tokens == 1 and self.num_output_tokens > 0
                and not self.is_awaiting_output)

    @property
    def is_awaiting_output(self) -> bool:
        """Every token it may still produce is already being sampled by a step in flight
        (max_tokens or the context window reached): nothing more to schedule."""
        if self.num_placeholders == 0:
            return False
        if self.num_output_tokens >= self.sampling_params.max_tokens:
            return True
        return self.max_model_len is not None and self.num_tokens >= self.max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    # -- lifecycle ---------------------------------------------------------------------
    def transition(self, new: RequestStatus) -> None:
        if new not in ALLOWED_TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"request {self.request_id}: illegal transition {self.status.name} -> {new.name}")
        self.status = new

    def append_token(self, token_id: int, now: float) -> None:
        """A sampled token came back (it replaces a placeholder when one is pending)."""
        if self.num_placeholders:
            self.num_placeholders -= 1
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def check_stop(self) -> FinishReason | None:
        """Token-level stop conditions after a new token (stop strings live in the detokenizer)."""
        p = self.sampling_params
        last = self.token_ids[-1]
        n_out = len(self.token_ids) - self.num_prompt_tokens   # known tokens only
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in p.stop_token_ids:
                return FinishReason.STOP
        if n_out >= p.max_tokens:
            return FinishReason.LENGTH
        if self.max_model_len is not None and len(self.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
