"""One request of a capture or replay as the diagnosis sees it (`Sample`), its TTFT split
into phases from the scheduler's trace (actors/scheduling/trace.py). Pure module.

The phases, in order, sum to the TTFT the client saw (the last one is what the server's
trace cannot see: the first chunk's way to the client):

    tokenization     request received -> tokenized (the tokenizer actor)
    routing          tokenized -> routed (the router: queue bound, worker choice)
                     (a trace without the `tokenized` event: one `tokenize_route` phase)
    queue            routed -> prefix lookup (waiting in the scheduler's queue)
    prefix_lookup    prefix lookup -> admitted (a KV plan granted)
    prefill_wait     admitted -> first prefill chunk started
    prefill          first prefill chunk -> prefill finished (every chunk, and the steps
                     between them)
    first_decode     prefill finished -> first token
    stream           first token (server) -> first chunk at the client (replays only)
"""

from __future__ import annotations

import dataclasses

PHASES = ("tokenization", "routing", "tokenize_route", "queue", "prefix_lookup",
          "prefill_wait", "prefill", "first_decode", "stream")
# Each phase ends at an event; it starts where the previous one ended.
_PHASE_END = (("tokenization", "tokenized"), ("routing", "routed"),
              ("tokenize_route", "routed"), ("queue", "prefix_cache_lookup_done"),
              ("prefix_lookup", "admitted"), ("prefill_wait", "prefill_started"),
              ("prefill", "prefill_finished"), ("first_decode", "first_token"))


@dataclasses.dataclass
class Sample:
    index: int
    t: float                            # offset in the capture (scheduled time)
    endpoint: str = "completions"
    tenant: str | None = None
    worker: int | None = None
    status: int = 200
    error: str | None = None
    ttft: float | None = None           # seconds
    e2e: float | None = None
    tpot: float | None = None           # (e2e - ttft) / (completion tokens - 1)
    itl: list[float] = dataclasses.field(default_factory=list)  # client-side gaps
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    hit_blocks: int | None = None
    miss_reason: str | None = None
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    preemptions: int = 0
    kv_refusals: int = 0
    prefill_chunks: int = 0
    decode_mean_gap: float | None = None    # server side (the trace)
    decode_max_gap: float | None = None
    spec_drafted: int = 0
    spec_accepted: int = 0
    prompt_token_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def prefill_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


def phases_of(trace: dict, client_ttft: float | None = None) -> dict[str, float]:
    """The phases of one trace (first occurrence of each event; a preempted request's
    recomputation is in its `prefill`). A phase whose end event is missing is left out."""
    first: dict[str, float] = {}
    for e in trace.get("events", ()):
        first.setdefault(e["event"], float(e["t"]))
    out: dict[str, float] = {}
    start = first.get("request_received", 0.0)
    split = "tokenized" in first
    for phase, end_event in _PHASE_END:
        end = first.get(end_event)
        if end is None or (phase == "tokenize_route" if split
                           else phase in ("tokenization", "routing")):
            continue
        out[phase] = max(0.0, end - start)
        start = end
    if client_ttft is not None and "first_token" in first:
        out["stream"] = max(0.0, client_ttft - first["first_token"])
    return out


def from_record(rec: dict, position: int) -> Sample:
    """A `request` (capture) or `response` (replay) line as a Sample."""
    metrics = rec.get("metrics") or {}
    usage = rec.get("usage") or {}
    traces = metrics.get("trace") or []
    trace = traces[0] if traces else None
    client_ttft = rec.get("ttft")
    s = Sample(index=int(rec.get("index", position)), t=float(rec.get("t", 0.0)),
               endpoint=rec.get("endpoint", "completions"), tenant=rec.get("tenant"),
               status=int(rec.get("status", 200)), error=rec.get("error"))
    s.ttft = client_ttft if client_ttft is not None else metrics.get("time_to_first_token")
    s.e2e = rec.get("e2e") if rec.get("e2e") is not None else metrics.get("e2e_time")
    s.itl = [float(g) for g in rec.get("itl") or ()]
    s.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    s.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    s.cached_tokens = int(details.get("cached_tokens") or metrics.get("cached_tokens") or 0)
    prefix = metrics.get("prefix_cache") or []
    if prefix:
        s.hit_blocks = prefix[0].get("hit_blocks")
        s.miss_reason = prefix[0].get("first_miss_reason")
    s.preemptions = int(metrics.get("num_preemptions") or 0)
    if s.ttft is not None and s.e2e is not None and s.completion_tokens > 1:
        s.tpot = max(0.0, s.e2e - s.ttft) / (s.completion_tokens - 1)
    if trace is not None:
        s.phases = phases_of(trace, client_ttft)
        s.kv_refusals = int(trace.get("kv_refusals") or 0)
        s.prefill_chunks = int(trace.get("prefill_chunks") or 0)
        decode = trace.get("decode") or {}
        s.decode_mean_gap = decode.get("mean_gap_s")
        s.decode_max_gap = decode.get("max_gap_s")
        spec = trace.get("speculation") or {}
        s.spec_drafted = int(spec.get("drafted") or 0)
        s.spec_accepted = int(spec.get("accepted") or 0)
        routing = trace.get("routing") or {}
        if routing.get("worker") is not None:
            s.worker = int(routing["worker"])
        if s.tenant is None:
            s.tenant = trace.get("tenant")
    ids = rec.get("prompt_token_ids")
    if isinstance(ids, list):
        s.prompt_token_ids = ids
    return s


def samples_of(records: list[dict]) -> list[Sample]:
    return [from_record(r, i) for i, r in enumerate(records)]
