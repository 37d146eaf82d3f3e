"""Conditional disaggregation: the whole request on one worker, or its prefill on a prefill
worker and the KV handed to a decode worker? The pure core of that choice (no asyncio, no
torch).

Both options are priced in seconds of waiting that users see, summed over the requests
affected (the decision's objective is total latency, not one request's):

    local  = ttft: (prompt tokens queued on the whole-request worker, of any role + this
                    prompt's uncached tokens there) * its prefill seconds per token
           + interference: every request decoding there waits for that prefill too (a
                    chunked prefill spreads it over their steps; the sum is the same)
           + on a prefill worker, the prefills forecast to arrive there while this request
                    decodes: its predicted decode time * that worker's forecast prefill duty
                    (eligible prompt tokens arriving per second over the last
                    ARRIVAL_WINDOW_S, this one included, * seconds per token / prefill
                    workers; at most 1).
                    The same steps also shrink those prefills' chunks (the SLO chunker keeps
                    the decode's ITL), so the term prices both sides of sharing the worker.
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

Placement follows the roles before any pricing: in "cost" mode a prompt too short to hand
off goes to a decode worker (a prefill worker only when none is up), as in "always". Such a
request lives mostly in decode, where one more row costs a decode worker little (each step
reads the weights once for all its rows), while on a prefill worker it would wait through
every long prefill sent there later. A router that spread short requests over every worker
had placed them before the first long prompt arrived, and no later choice could help them.

The rates are learned: seconds per prefill token per worker from each finished request's
timings (at the load it ran under), seconds per decoded token from each request's first
few tokens and from its whole output when it ends, the handoff bandwidth from each decode
worker's restore. Before the first measurement the priors are used (for decode: no
forecast term until a request has decoded a few tokens).
"""

from __future__ import annotations

import collections
import dataclasses

MODES = ("cost", "always", "never")
EWMA = 0.3     # weight of a new measurement
# The window over which prompt arrivals forecast a prefill worker's duty: long enough to
# hold a few long prompts of a steady stream, short enough to forget a finished burst.
ARRIVAL_WINDOW_S = 20.0


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
    decode_s_per_token: float | None = None   # None until a request has decoded
    num_prefill_samples: int = 0
    num_transfer_samples: int = 0
    num_decode_samples: int = 0
    # (time, uncached tokens) of the prompts long enough to hand off, oldest first
    arrivals: collections.deque = dataclasses.field(default_factory=collections.deque)

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

    def observe_decode(self, tokens: int, seconds: float) -> None:
        """A request decoded `tokens` tokens after its first in `seconds` (its ITL, at the
        load it ran under)."""
        if tokens < 2 or seconds <= 0:
            return
        rate = seconds / tokens
        old = self.decode_s_per_token
        self.decode_s_per_token = rate if old is None else old + EWMA * (rate - old)
        self.num_decode_samples += 1

    def observe_arrival(self, tokens: int, now: float) -> None:
        """A prompt long enough to hand off arrived with `tokens` uncached tokens."""
        self.arrivals.append((now, tokens))
        self._forget(now)

    def prefill_token_rate(self, now: float) -> float:
        """Eligible prompt tokens arriving per second: those of the last ARRIVAL_WINDOW_S
        over the window (a long prompt just seen is expected to recur within it)."""
        self._forget(now)
        return sum(t for _, t in self.arrivals) / ARRIVAL_WINDOW_S

    def _forget(self, now: float) -> None:
        while self.arrivals and self.arrivals[0][0] < now - ARRIVAL_WINDOW_S:
            self.arrivals.popleft()


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

    def prefill_duty(self, now: float) -> float:
        """The forecast fraction of a prefill worker's time its prefills will take: the
        eligible prompt tokens arriving per second, spread over the prefill workers, at
        their learned seconds per token (at most 1: a saturated worker)."""
        if not self.prefill_workers:
            return 0.0
        r = self.rates
        s_per_token = sum(r.prefill_s_per_token[w] for w in self.prefill_workers) \
            / len(self.prefill_workers)
        return min(1.0, r.prefill_token_rate(now) * s_per_token / len(self.prefill_workers))

    def roles(self, num_workers: int) -> list[str]:
        return ["prefill" if w in self.prefill_workers else "decode"
                for w in range(num_workers)]

    def stats(self, now: float | None = None) -> dict:
        r = self.rates
        out = {"mode": self.mode, "decisions": dict(self.decisions),
               "prefill_ms_per_token": [round(x * 1e3, 4) for x in r.prefill_s_per_token],
               "transfer_mb_s": round(r.transfer_bytes_per_s / 1e6, 1),
               "decode_ms_per_token": (None if r.decode_s_per_token is None
                                       else round(r.decode_s_per_token * 1e3, 3)),
               "prefill_samples": r.num_prefill_samples,
               "transfer_samples": r.num_transfer_samples,
               "decode_samples": r.num_decode_samples}
        if now is not None:
            out["prefill_duty_forecast"] = round(self.prefill_duty(now), 3)
        return out


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
    # the part of local_s that is the forecast prefills on a prefill worker (0: none)
    forecast_interference_s: float = 0.0

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(x * 1e3, 3)   # noqa: E731
        return {"remote_prefill": self.remote, "reason": self.reason,
                "predicted_local_ms": r(self.local_s), "predicted_remote_ms": r(self.remote_s),
                "transfer_bytes": self.transfer_bytes,
                "predicted_transfer_ms": r(self.predicted_transfer_s),
                "forecast_interference_ms": r(self.forecast_interference_s)}


def choose(mode: str, prompt_tokens: int, block_size: int, kv_bytes_per_token: int,
           decode: Side | None, prefill: Side | None, rates: Rates, min_remote_tokens: int,
           eligible: bool = True, local: Side | None = None, decode_tokens: int = 0,
           local_duty: float = 0.0) -> Choice:
    """Local or remote prefill for one request; see the module docstring. `local`: the
    worker that would run the whole request (default: `decode`, the one that would decode
    it after a handoff); `decode_tokens`: the tokens it may decode (max_tokens);
    `local_duty`: the forecast prefill duty of `local` (Settings.prefill_duty when it is a
    prefill worker, else 0)."""
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
    forecast_s = 0.0
    if local_duty > 0 and rates.decode_s_per_token is not None:
        forecast_s = decode_tokens * rates.decode_s_per_token * local_duty
    local_s = (local.queued_tokens * l_rate + local_prefill) + local.decoding * local_prefill \
        + forecast_s
    tail_s = min(tail, decode.uncached_tokens) * d_rate
    remote_ttft = ((prefill.queued_tokens + prefill.uncached_tokens) * p_rate + transfer_s
                   + decode.queued_tokens * d_rate + tail_s)
    # The prefill worker's own decoding requests (it may take whole requests too) wait
    # through the remote prefill; the decode worker's only through the tail.
    remote_s = remote_ttft + decode.decoding * tail_s \
        + prefill.decoding * prefill.uncached_tokens * p_rate
    if mode == "always":
        return Choice(True, "always", local_s, remote_s, transfer_bytes, transfer_s,
                      forecast_s)
    return Choice(remote_s < local_s, "cost", local_s, remote_s, transfer_bytes, transfer_s,
                  forecast_s)
