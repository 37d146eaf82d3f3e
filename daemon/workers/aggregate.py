"""One EngineStats from several workers' (admin `stats` and /metrics show the daemon as a
whole; per-worker figures are labelled separately). Pure.

Counts and totals add up (requests, steps, blocks, token counters, histograms kept as
dicts); ratios are recomputed from the sums (KV usage) or averaged (means, cost-model
coefficients: one worker's is as good as another's); flags are true if any worker's is.
Settings every worker shares (block size, speculative k) and bounds (the longest decode
skip) are not summed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenloom.actors.messages import EngineStats, RouterStats


def combine(values: list[Any]) -> Any:
    if any(v is None for v in values):   # optional figures some workers lack (none yet)
        present = [v for v in values if v is not None]
        return combine(present) if present else None
    first = values[0]
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, int):
        return sum(values)
    if isinstance(first, float):
        return sum(values) / len(values)
    if isinstance(first, msgspec.Struct):
        fields = {f: combine([getattr(v, f) for v in values]) for f in first.__struct_fields__}
        return type(first)(**fields)
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: combine([v[k] for v in values if k in v]) for k in keys}
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first)
                                       for v in values) and \
            all(isinstance(x, (int, float)) and not isinstance(x, bool)
                for v in values for x in v):
        return [combine(list(col)) for col in zip(*values)]
    return first


def engine_stats(per_worker: list[EngineStats], router: RouterStats) -> EngineStats:
    """The workers' stats as one engine's; `router` is the front's own."""
    replace = msgspec.structs.replace
    total = combine(per_worker)
    first = per_worker[0]
    kv = total.kv
    kv = replace(kv, usage=kv.used / kv.num_blocks if kv.num_blocks else 0.0,
                 block_size=first.kv.block_size)
    sched = replace(total.scheduler,
                    max_decode_skip=max(s.scheduler.max_decode_skip for s in per_worker))
    if sched.spec is not None and first.scheduler.spec is not None:
        sched = replace(sched, spec=replace(
            sched.spec, num_speculative_tokens=first.scheduler.spec.num_speculative_tokens))
    # The KV storage is a shared setting; the check's extremes are the workers' worst.
    quant = replace(total.kv_quant, bytes_per_token=first.kv_quant.bytes_per_token,
                    check_fraction=first.kv_quant.check_fraction,
                    check_max_kl=max(s.kv_quant.check_max_kl for s in per_worker),
                    check_max_error=max(s.kv_quant.check_max_error for s in per_worker),
                    check_last_kl=max(s.kv_quant.check_last_kl for s in per_worker),
                    promoted_layers=sorted({i for s in per_worker
                                            for i in s.kv_quant.promoted_layers}))
    loras = [s.scheduler.lora for s in per_worker if s.scheduler.lora is not None]
    if loras:   # the same slots on every worker: the adapters are the union, not a sum

        def union(field: str) -> list[str]:
            return sorted({n for x in loras for n in getattr(x, field) if n})
        sched = replace(sched, lora=replace(
            sched.lora, max_loras=loras[0].max_loras, registered=union("registered"),
            resident=union("resident"), running=union("running"), waiting=union("waiting")))
    return replace(total, kv=kv, scheduler=sched, router=router, kv_quant=quant)
