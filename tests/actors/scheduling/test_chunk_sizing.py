"""The SLO chunker's floor: with `min_prefill_chunk` 0 the ITL target decides
how small a chunk gets, down to one KV block; a value above 0 is a hard floor; before the
cost model knows what prefill costs, prefill gets the floor."""

import pytest

from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.actors.scheduling.chunk_sizing import ChunkSizer
from tokenloom.actors.scheduling.cost_model import StepCostModel, attention_work
from tokenloom.actors.scheduling.request import Request
from tokenloom.config.schema import SchedulerConfig

C0, PER_TOKEN = 0.010, 0.001    # a slow machine: 64 prefill tokens cost 6 decode-only steps


def fitted() -> StepCostModel:
    """A cost model fitted on exact step times C0 + PER_TOKEN * tokens."""
    m = StepCostModel()
    for decodes in range(1, 17):
        for chunk in (0, 16, 128):
            tokens = decodes + chunk
            m.observe(tokens, 0.0, C0 + PER_TOKEN * tokens, prefill_tokens=chunk,
                      rows=decodes)
    assert m.knows_prefill
    return m


def decoding(n: int) -> list[Request]:
    out = []
    for i in range(n):
        r = Request(f"d{i}", list(range(3, 53)), SamplingParams(max_tokens=64))
        r.append_token(7, 0.0)
        r.num_computed_tokens = r.num_tokens - 1
        assert r.is_decode
        out.append(r)
    return out


WAITING = [Request("w", list(range(3, 1503)), SamplingParams())]   # a 1,500-token prompt


def settled(sizer: ChunkSizer, decodes: list[Request]) -> int:
    """The budget once the at-most-doubling ramp has caught up."""
    for _ in range(12):
        budget = sizer.prefill_budget(decodes, WAITING)
    assert budget is not None
    return budget


def predicted(cost: StepCostModel, decodes: list[Request], prefill: int) -> float:
    attn = sum(attention_work(1, r.num_computed_tokens) for r in decodes)
    return cost.predict(len(decodes) + prefill, attn + attention_work(prefill, 0),
                        rows=len(decodes))


def test_the_floor_follows_the_target_below_64_tokens():
    """4 streams, target 40 ms: 64 prefill tokens would make a 78 ms step. The old fixed
    64-token floor ran them anyway; now the chunk is the most that fits (~26 tokens)."""
    cost, decodes = fitted(), decoding(4)
    cfg = SchedulerConfig(chunking="slo", target_itl_ms=40.0, min_prefill_chunk=0)
    sizer = ChunkSizer(cfg, 2048, cost)
    assert predicted(cost, decodes, 64) > 0.040
    budget = settled(sizer, decodes)
    assert 16 <= budget < 64
    assert predicted(cost, decodes, budget) <= 0.040
    assert predicted(cost, decodes, budget + 1) > 0.040     # the largest that fits
    assert sizer.last_budget == budget
    assert sizer.steady_budget(decodes) == budget


def test_an_unreachable_target_still_gives_one_block_so_prompts_progress():
    cost, decodes = fitted(), decoding(4)
    for block_size in (16, 32):
        cfg = SchedulerConfig(chunking="slo", target_itl_ms=0.001, min_prefill_chunk=0)
        sizer = ChunkSizer(cfg, 2048, cost, block_size)
        assert settled(sizer, decodes) == block_size
        assert sizer.steady_budget(decodes) == block_size


def test_an_explicit_min_prefill_chunk_is_a_hard_floor():
    cost, decodes = fitted(), decoding(4)
    cfg = SchedulerConfig(chunking="slo", target_itl_ms=40.0, min_prefill_chunk=64)
    sizer = ChunkSizer(cfg, 2048, cost)
    assert settled(sizer, decodes) == 64
    assert sizer.steady_budget(decodes) == 64


@pytest.mark.parametrize("min_prefill_chunk, floor", [(0, 16), (48, 48)])
def test_before_the_fit_prefill_gets_the_floor(min_prefill_chunk, floor):
    unfitted, decodes = StepCostModel(), decoding(4)
    cfg = SchedulerConfig(chunking="slo", target_itl_ms=40.0,
                          min_prefill_chunk=min_prefill_chunk)
    sizer = ChunkSizer(cfg, 2048, unfitted, block_size=16)
    assert sizer.prefill_budget(decodes, WAITING) == floor
    assert sizer.steady_budget(decodes) == floor
    # The floor never exceeds the iteration's room beside the decodes.
    assert ChunkSizer(cfg, 18, unfitted).prefill_budget(decodes, WAITING) == min(floor, 14)
