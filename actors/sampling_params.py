"""Per-request sampling parameters: a frozen msgspec Struct that crosses process boundaries.

Contract: a `SamplingParams` that exists is valid. `__post_init__` runs both on construction and
when msgspec decodes one, and raises `ValueError` naming the offending field and its allowed
range (msgspec wraps it in `msgspec.ValidationError`, itself a `ValueError`, when decoding).
Values are normalised on the way in: int -> float for float fields, list -> tuple for sequences,
so two equal requests compare and hash equal.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from msgspec.structs import force_setattr

MAX_N = 128
MAX_LOGPROBS = 20
SPECULATIVE_MODES = ("auto", "on", "off")
PENALTY_RANGE = (-2.0, 2.0)
# torch.Generator.manual_seed accepts exactly this range, and msgspec encodes int64/uint64 only.
SEED_RANGE = (-(2**63), 2**64 - 1)


GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# SamplingParams.pooling: which prompt positions' hidden states make the embedding.
POOLING_KINDS = ("last", "mean", "cls")


class ReasoningGate(msgspec.Struct, frozen=True):
    """Where a constraint starts when the model thinks first: structured output and tool
    calls apply to the answer, not the thinking (daemon/openai/reasoning.py). Tokens pass
    unconstrained while the output is thinking, which it is from the start when `opened`
    (the prompt opened it), or once its first token is `start_token_id` (-1: the output
    never opens it itself); the constraint starts after `end_token_id`. The tags must be
    single tokens."""

    end_token_id: int
    start_token_id: int = -1
    opened: bool = False


class GuidedDecoding(msgspec.Struct, frozen=True):
    """A constraint on the output (structured output): `kind` in GUIDED_KINDS and its `spec`
    as text: a JSON schema (json_schema), a regex, a JSON list of strings (choice), an EBNF
    grammar (grammar), or "" (json_object: any JSON object). Compiled by
    actors/execution/guided.py. `gate`: the thinking it starts after (None: from the first
    token)."""

    kind: str
    spec: str = ""
    gate: ReasoningGate | None = None


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """How to pick the next tokens of one request (vLLM/OpenAI semantics).

    temperature 0 means greedy. top_k 0 or -1 disables top-k. repetition_penalty follows
    Hugging Face (tokens seen in prompt or output); presence/frequency penalties follow OpenAI
    (output tokens only). logprobs None returns no logprobs; k in 0..20 returns the sampled
    token's logprob plus the k most likely alternatives; prompt_logprobs likewise for each
    prompt token after the first. `stop` strings are matched by the
    detokenizer, not here.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's prompt_logprobs: None returns none; k in 0..20 returns the logprob of each prompt
    # token after the first (from the prefill's own logits) plus the k most likely tokens at
    # each position. Bounded per request by scheduler.max_prompt_logprobs_tokens.
    prompt_logprobs: int | None = None
    # Speculative decoding for this request: "auto" (the engine's kill switch decides),
    # "on" (whenever there is a proposal) or "off". No effect when the engine has no
    # proposer configured (speculative.method = "off").
    speculative: str = "auto"
    # Structured output: the output must match this constraint (None: unconstrained).
    # Constrained requests never speculate (the verifier has no grammar masks).
    guided: GuidedDecoding | None = None
    # Embeddings (POST /v1/embeddings): the request computes its prompt only and the runner
    # returns the final-normed hidden state pooled over it: the last position's ("last"),
    # the mean of all ("mean") or the first's ("cls"), as messages.PooledOutput.
    pooling: str | None = None

    def __post_init__(self) -> None:
        _check_int(self, "n", lo=1, hi=MAX_N)
        _check_int(self, "max_tokens", lo=1)
        _check_int(self, "min_tokens", lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_float(self, "temperature", lambda x: x >= 0, ">= 0")
        _check_float(self, "top_p", lambda x: 0 < x <= 1, "in (0, 1]")
        # -1 and 0 both mean "disabled" (vLLM uses -1, Hugging Face uses 0).
        _check_int(self, "top_k", lo=-1)
        _check_float(self, "min_p", lambda x: 0 <= x <= 1, "in [0, 1]")
        if self.seed is not None:
            _check_int(self, "seed", lo=SEED_RANGE[0], hi=SEED_RANGE[1])
        _check_float(self, "repetition_penalty", lambda x: x > 0, "> 0")
        lo, hi = PENALTY_RANGE
        _check_float(self, "presence_penalty", lambda x: lo <= x <= hi, f"in [{lo}, {hi}]")
        _check_float(self, "frequency_penalty", lambda x: lo <= x <= hi, f"in [{lo}, {hi}]")
        _check_stop_token_ids(self)
        _check_stop(self)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int(self, "logprobs", lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int(self, "prompt_logprobs", lo=0, hi=MAX_LOGPROBS)
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                             f"got {self.speculative!r}")
        if self.guided is not None:
            _check_guided(self)
        if self.pooling is not None and self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}, got "
                             f"{self.pooling!r}")

    @classmethod
    def greedy(cls, max_tokens: int = 16, **kwargs: Any) -> SamplingParams:
        """Deterministic argmax decoding."""
        return cls(temperature=0.0, max_tokens=max_tokens, **kwargs)

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the penalised logits (no RNG needed)."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition/presence/frequency penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `max_tokens=True` is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(params: SamplingParams, name: str, lo: int, hi: int | None = None) -> None:
    value = getattr(params, name)
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    if not _is_int(value):
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_float(params: SamplingParams, name: str, ok: Any, allowed: str) -> None:
    value = getattr(params, name)
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    value = float(value)
    # `ok` alone would let NaN through the negated forms and +inf through the one-sided ones.
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    force_setattr(params, name, value)


def _check_stop_token_ids(params: SamplingParams) -> None:
    ids = params.stop_token_ids
    if not isinstance(ids, (tuple, list)) or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids must be a sequence of ints >= 0, got {ids!r}")
    force_setattr(params, "stop_token_ids", tuple(ids))


def _check_stop(params: SamplingParams) -> None:
    stop = params.stop
    # A bare string would otherwise be accepted as a tuple of one-character stops.
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a sequence of non-empty strings, got {stop!r}")
    force_setattr(params, "stop", tuple(stop))


def _check_guided(params: SamplingParams) -> None:
    g = params.guided
    if not isinstance(g, GuidedDecoding):
        raise ValueError(f"guided must be a GuidedDecoding, got {g!r}")
    if g.kind not in GUIDED_KINDS:
        raise ValueError(f"guided.kind must be one of {', '.join(GUIDED_KINDS)}, got {g.kind!r}")
    if not isinstance(g.spec, str):
        raise ValueError(f"guided.spec must be a string, got {g.spec!r}")
    if g.kind != "json_object" and not g.spec:
        raise ValueError(f"guided.spec must be non-empty for kind {g.kind!r}")
    if g.kind == "choice":
        try:
            choices = msgspec.json.decode(g.spec)
        except msgspec.DecodeError:
            choices = None
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise ValueError(f"guided.spec of a choice must be a JSON list of non-empty "
                             f"strings, got {g.spec!r}")
    if params.ignore_eos:
        # The grammar's end allows only EOS; ignoring it would leave no legal token.
        raise ValueError("ignore_eos cannot be combined with guided decoding")
