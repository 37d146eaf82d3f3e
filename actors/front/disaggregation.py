"""Conditional disaggregation: the whole request on one worker, or its prefill on a prefill
worker and the KV handed to a decode worker? The pure core of that choice (no asyncio, no
torch).

Both options are priced in seconds of waiting that users see, summed over the requests
affected (the decision's objective is total latency, not one request's):

    local  = ttft: (prompt tokens queued on the whole-request worker, of any role + this
                    prompt's uncached tokens there) * its prefill seconds per token
           + interference: every request decoding there waits for that prefill too (a
                    chunked prefill spreads it over their steps; the sum is the same)
    remote = ttft: (tokens queued on the prefill worker + uncached tokens there) * its
                    seconds per token
                  + transfer: prompt KV bytes / measured handoff bandwidth + latency
                  + the tail the decode worker recomputes (the last, partial block and the
                    last token, whose logits it samples the first token from)
           + interference: the decode worker's decoding requests wait only for that tail,
                    the prefill worker's (it may serve whole requests too) for the prefill

Remote wins when it is cheaper. Prompts with fewer uncached tokens than
``min_remote_tokens`` always stay local (Dynamo's length threshold: a short prefill costs
less than the handoff's fixed overheads), and so does any request the handoff cannot carry
(prompt logprobs need every prompt position's logits on the decode side).

The rates are learned: seconds per prefill token per worker from each finished request's
timings (at the load it ran under), the handoff bandwidth from each decode worker's
restore. Before the first measurement the priors are used.
"""

from __future__ import annotations

import dataclasses

MODES = ("cost", "always", "never")
EWMA = 0.3     # weight of a new measurement


PREFILL_SUFFIX = "@prefill"


def prefill_id(request_id: str) -> str:
    """The engine request id of a handoff's prefill half."""
    return request_id + PREFILL_SUFFIX


def decode_id(engine_request_id: str) -> str | None:
    """The request a prefill half belongs to (None: not a prefill half)."""
    if engine_request_id.endswith(PREFILL_SUFFIX):
        return engine_request_id[:-len(PREFILL_SUFFIX)]
    return None


@dataclasses.dataclass
class Rates:
    """What the cost model has learned (EWMA over measurements)."""
    prefill_s_per_token: list[float]      # per worker
    transfer_bytes_per_s: float
    transfer_latency_s: float = 0.0005
    num_prefill_samples: int = 0
    num_transfer_samples: int = 0

    def observe_prefill(self, worker: int, tokens: int, seconds: float) -> None:
        if tokens < 16 or seconds <= 0:   # a few tokens measure the step overhead, not prefill
            return
        rate = seconds / tokens
        old = self.prefill_s_per_token[worker]
        self.prefill_s_per_token[worker] = old + EWMA * (rate - old)
        self.num_prefill_samples += 1

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        bw = nbytes / seconds
        self.transfer_bytes_per_s += EWMA * (bw - self.transfer_bytes_per_s)
        self.num_transfer_samples += 1


@dataclasses.dataclass
class Settings:
    """The router's disaggregation setup: which workers have which role, the mode, and
    what it has decided so far."""
    mode: str
    prefill_workers: list[int]
    decode_workers: list[int]
    min_remote_tokens: int
    kv_bytes_per_token: int
    rates: Rates
    decisions: dict[str, int] = dataclasses.field(default_factory=dict)   # "remote:cost" ...

    def count(self, choice: "Choice") -> None:
        key = f"{'remote' if choice.remote else 'local'}:{choice.reason}"
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def roles(self, num_workers: int) -> list[str]:
        return ["prefill" if w in self.prefill_workers else "decode"
                for w in range(num_workers)]

    def stats(self) -> dict:
        r = self.rates
        return {"mode": self.mode, "decisions": dict(self.decisions),
                "prefill_ms_per_token": [round(x * 1e3, 4) for x in r.prefill_s_per_token],
                "transfer_mb_s": round(r.transfer_bytes_per_s / 1e6, 1),
                "prefill_samples": r.num_prefill_samples,
                "transfer_samples": r.num_transfer_samples}


@dataclasses.dataclass(frozen=True)
class Side:
    """One worker's state as the router sees it, for this request."""
    worker: int
    uncached_tokens: int       # prompt tokens it would have to compute
    queued_tokens: int         # prompt tokens routed to it and not yet prefilled
    decoding: int              # requests decoding on it


@dataclasses.dataclass(frozen=True)
class Choice:
    remote: bool
    # cost | always | never | short_prompt | ineligible | no_prefill_worker
    reason: str
    local_s: float | None = None
    remote_s: float | None = None
    transfer_bytes: int = 0
    predicted_transfer_s: float | None = None

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(x * 1e3, 3)   # noqa: E731
        return {"remote_prefill": self.remote, "reason": self.reason,
                "predicted_local_ms": r(self.local_s), "predicted_remote_ms": r(self.remote_s),
                "transfer_bytes": self.transfer_bytes,
                "predicted_transfer_ms": r(self.predicted_transfer_s)}


def choose(mode: str, prompt_tokens: int, block_size: int, kv_bytes_per_token: int,
           decode: Side | None, prefill: Side | None, rates: Rates, min_remote_tokens: int,
           eligible: bool = True, local: Side | None = None) -> Choice:
    """Local or remote prefill for one request; see the module docstring. `local`: the
    worker that would run the whole request (default: `decode`, the one that would decode
    it after a handoff)."""
    if mode not in MODES:
        raise ValueError(f"disaggregation mode must be one of {MODES}, got {mode!r}")
    if mode == "never":
        return Choice(False, "never")
    if not eligible:
        return Choice(False, "ineligible")
    if prefill is None or decode is None:
        return Choice(False, "no_prefill_worker" if prefill is None else "no_decode_worker")
    local = local or decode
    # The decode worker restores the full blocks before the last token and recomputes from
    # there (the first token is sampled from its own logits).
    full = max(0, (prompt_tokens - 1) // block_size) * block_size
    tail = prompt_tokens - full
    moved = max(0, full - (prompt_tokens - decode.uncached_tokens))
    transfer_bytes = moved * kv_bytes_per_token
    transfer_s = (rates.transfer_latency_s + transfer_bytes / rates.transfer_bytes_per_s
                  if transfer_bytes else 0.0)
    if decode.uncached_tokens < min_remote_tokens:
        return Choice(False, "short_prompt", transfer_bytes=transfer_bytes)
    l_rate = rates.prefill_s_per_token[local.worker]
    d_rate = rates.prefill_s_per_token[decode.worker]
    p_rate = rates.prefill_s_per_token[prefill.worker]
    local_prefill = local.uncached_tokens * l_rate
    local_s = (local.queued_tokens * l_rate + local_prefill) + local.decoding * local_prefill
    tail_s = min(tail, decode.uncached_tokens) * d_rate
    remote_ttft = ((prefill.queued_tokens + prefill.uncached_tokens) * p_rate + transfer_s
                   + decode.queued_tokens * d_rate + tail_s)
    # The prefill worker's own decoding requests (it may take whole requests too) wait
    # through the remote prefill; the decode worker's only through the tail.
    remote_s = remote_ttft + decode.decoding * tail_s \
        + prefill.decoding * prefill.uncached_tokens * p_rate
    if mode == "always":
        return Choice(True, "always", local_s, remote_s, transfer_bytes, transfer_s)
    return Choice(remote_s < local_s, "cost", local_s, remote_s, transfer_bytes, transfer_s)
