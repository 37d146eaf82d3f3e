"""SLO-driven chunk sizing: how many prefill tokens the next iteration may carry so that the
running decodes still meet their inter-token latency target. Pure (no asyncio, no torch).

The step-cost model (cost_model.py) predicts an iteration's time from its tokens and
attention work. Each iteration gets the most prefill tokens within `target_itl_ms`
(0 = `auto_itl_factor` × the predicted decode-only iteration), never fewer than the floor;
while the model has not seen prefill iterations, prefill gets the floor. The floor is
`min_prefill_chunk` when set above 0 (64 by default), else one KV block (0: the target
decides, down to a block). A floor above 0 is a floor in time: an iteration may always take
as long as those decodes plus `min_prefill_chunk` tokens at the start of a prompt, even
when that overruns the target. Deeper into a long prompt the same token count costs more
(the chunk attends to its whole context), so there the chunk is the most that fits that
time, at least one KV block (a chunk whose extra cost is within the target's headroom
over a decode-only step keeps its whole floor): steps stay about as long at the end of a
2,000-token prompt as at its start, instead of growing with it (on 2 cores a 64-token
chunk after 1,936 cached tokens beside 4 decodes made ~110 ms steps against ~55 at the
start, and those steps set the short streams' ITL p99 under long-prompt interference).
The budget at most doubles from one iteration to the next, so one bad fit (noise) cannot
turn into one multi-second iteration before the model sees its mistake.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from tokenloom.actors.scheduling.cost_model import StepCostModel, attention_work
from tokenloom.actors.scheduling.request import Request
from tokenloom.config.schema import SchedulerConfig


class ChunkSizer:
    def __init__(self, config: SchedulerConfig, max_num_batched_tokens: int,
                 cost: StepCostModel, block_size: int = 16):
        self.config = config
        self.max_tokens = max_num_batched_tokens
        self.cost = cost
        # The progress floor when min_prefill_chunk is 0: one KV block. A fixed 64 tokens
        # cost several decode steps on 2 cores (short-stream ITL p99 5.4x p50 with 1,500-
        # token prompts arriving), so the target must be able to go below it; a block is the
        # unit KV is allocated and prefix-cached in, so a block-sized chunk still fills whole
        # blocks, and a P-token prompt still finishes within ceil(P / block_size) iterations.
        self.floor = config.min_prefill_chunk or block_size
        self.block_size = block_size
        self.last_budget: int | None = None   # for stats: the latest SLO budget, None = static
        self._last_slo_chunk = 0

    def steady_budget(self, running: Sequence[Request], start: int = 0) -> int:
        """The chunk a prompt continuing at `start` would get beside the running decodes,
        once the budget has ramped up (no state changes): what the KV tiers' planner needs
        to price a recompute at the current load."""
        cfg = self.config
        decodes = [r for r in running if r.is_decode]
        if cfg.chunking != "slo" or not decodes:
            return self.max_tokens
        hi = max(1, self.max_tokens - len(decodes))
        lo = min(self.floor, hi)
        if not self.cost.knows_prefill:
            return lo
        plain_attn = sum(attention_work(1, r.num_computed_tokens) for r in decodes)
        target = (cfg.target_itl_ms / 1000 if cfg.target_itl_ms > 0 else
                  cfg.auto_itl_factor * self.cost.predict(len(decodes), plain_attn))
        return self._chunk(target, len(decodes), plain_attn, start, lo, hi)

    def _chunk(self, target: float, decode_tokens: int, decode_attn, start: int, lo: int,
               hi: int) -> int:
        """The most prefill tokens continuing a prompt at `start` within `target`, with the
        floor (module docstring): with min_prefill_chunk > 0, a floor in time (what `lo`
        tokens cost at a prompt's start beside these decodes; one KV block of progress at
        least), except that a chunk whose `lo` tokens cost no more than that plus the SLO's
        own headroom over a decode-only step (auto_itl_factor - 1 of it) keeps all `lo`:
        a 256-token prompt's later chunks then stay whole instead of leaving a tail of a few
        tokens for one more mixed step, and only chunks deep in a long prompt shrink."""
        cost = self.cost
        if not self.config.min_prefill_chunk:
            return cost.max_prefill_tokens(target, decode_tokens, decode_attn, start, lo, hi)
        floor_time = cost.predict(decode_tokens + lo, decode_attn + attention_work(lo, 0),
                                  rows=decode_tokens)
        budget = cost.max_prefill_tokens(max(target, floor_time), decode_tokens, decode_attn,
                                         start, min(self.block_size, lo), hi)
        if budget < lo:
            headroom = (self.config.auto_itl_factor - 1) * cost.predict(decode_tokens,
                                                                         decode_attn)
            at_start = cost.predict(decode_tokens + lo, decode_attn + attention_work(lo, start),
                                    rows=decode_tokens)
            if at_start <= floor_time + headroom:
                budget = lo
        return budget

    def prefill_budget(self, running: Sequence[Request], waiting: Sequence[Request],
                       drafts: Mapping[str, int] | None = None) -> int | None:
        """The prefill token budget for the next iteration; None: the static budget
        (chunking "static", or nothing decoding to protect). `drafts`: the speculative
        tokens decodes verify this iteration; they cost time inside the same target."""
        cfg = self.config
        self.last_budget = None
        if cfg.chunking != "slo":
            return None
        decodes = [r for r in running if r.is_decode]
        if not decodes:
            return None
        if not self.cost.knows_prefill:
            # Streams are decoding but prefill costs are unknown yet: protect them with the
            # smallest chunk until the model has seen prefill iterations.
            self.last_budget = min(self.floor, max(1, self.max_tokens - len(decodes)))
            return self.last_budget
        plain_attn = sum(attention_work(1, r.num_computed_tokens) for r in decodes)
        if cfg.target_itl_ms > 0:
            target = cfg.target_itl_ms / 1000
        else:
            target = cfg.auto_itl_factor * self.cost.predict(len(decodes), plain_attn)
        drafts = drafts or {}
        spec = sum(drafts.get(r.request_id, 0) for r in decodes)
        d_attn = plain_attn if not spec else sum(
            attention_work(1 + drafts.get(r.request_id, 0), r.num_computed_tokens)
            for r in decodes)
        prefilling = [r for r in running if not r.is_decode and not r.is_awaiting_output]
        head = prefilling[0] if prefilling else (waiting[0] if waiting else None)
        if head is None:
            return None
        hi = max(1, self.max_tokens - len(decodes) - spec)
        lo = min(self.floor, hi)
        budget = self._chunk(target, len(decodes) + spec, d_attn, head.num_computed_tokens,
                             lo, hi)
        budget = min(budget, max(lo, 2 * self._last_slo_chunk))
        self._last_slo_chunk = budget
        self.last_budget = budget
        return budget
