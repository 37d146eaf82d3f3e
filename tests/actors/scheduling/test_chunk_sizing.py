"""The SLO chunker's floor: with `min_prefill_chunk` 0 the ITL target decides
how small a chunk gets, down to one KV block; a value above 0 is a floor in time (what that
many tokens cost at a prompt's start, overriding the target; deeper into a long prompt the
chunk is the most that fits that time); before the cost model knows what prefill costs,
prefill gets the floor."""

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


def test_an_explicit_min_prefill_chunk_overrides_the_target():
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


PER_MPAIR = 0.25   # seconds per million causal query-key pairs (a 64-token chunk after
#                    1,936 cached tokens: ~31 ms of attention beside ~64 ms of tokens)


def fitted_with_attention() -> StepCostModel:
    m = StepCostModel()
    for decodes in range(1, 17):
        for chunk, start in ((0, 0), (16, 0), (128, 0), (64, 500), (64, 1500), (128, 1000)):
            attn = (sum((attention_work(1, 50) for _ in range(decodes)), attention_work(0, 0))
                    + attention_work(chunk, start))
            tokens = decodes + chunk
            m.observe(tokens, attn, C0 + PER_TOKEN * tokens + PER_MPAIR * attn.pairs,
                      prefill_tokens=chunk, rows=decodes)
    assert m.knows_prefill
    return m


def test_deep_in_a_long_prompt_the_floor_holds_its_time_not_its_token_count():
    """min_prefill_chunk 64 with an unreachable 40 ms target: the first chunk of a prompt
    gets the 64 tokens; a chunk after 1,936 cached tokens would cost more for the same
    count (it attends to all of them), so it gets the most tokens that fit the first
    chunk's step time: the step stays as long, not longer. At least a block always."""
    cost, decodes = fitted_with_attention(), decoding(4)
    cfg = SchedulerConfig(chunking="slo", target_itl_ms=40.0, min_prefill_chunk=64)
    attn = sum(attention_work(1, r.num_computed_tokens) for r in decodes)

    def step(prefill: int, start: int) -> float:
        return cost.predict(4 + prefill, attn + attention_work(prefill, start), rows=4)

    fresh = ChunkSizer(cfg, 2048, cost, block_size=16)
    assert settled(fresh, decodes) == 64
    deep = Request("deep", list(range(3, 2503)), SamplingParams())
    deep.num_computed_tokens = 1936            # e.g. its earlier chunks, or a prefix hit
    sizer = ChunkSizer(cfg, 2048, cost, block_size=16)
    for _ in range(12):
        budget = sizer.prefill_budget(decodes, [deep])
    assert step(64, 1936) > 1.2 * step(64, 0)   # what the old token floor would have run
    assert 16 <= budget < 64
    assert step(budget, 1936) <= step(64, 0) < step(budget + 1, 1936)
    assert sizer.steady_budget(decodes, start=1936) == budget
    # However costly the context, a block of progress.
    deeper = ChunkSizer(cfg, 2048, cost, block_size=16)
    deep.num_computed_tokens = 200_000
    assert deeper.prefill_budget(decodes, [deep]) == 16


def test_a_chunk_a_little_deeper_keeps_the_whole_floor():
    """A 256-token prompt's later chunks (after 64-192 tokens) cost a little more than its
    first; within the target's headroom over a decode-only step they keep all 64 tokens,
    so the prompt still takes 4 chunks, not 5 with a tail of a few tokens."""
    cost, decodes = fitted_with_attention(), decoding(4)
    attn = sum(attention_work(1, r.num_computed_tokens) for r in decodes)
    decode_only = cost.predict(4, attn)
    cfg = SchedulerConfig(chunking="slo", auto_itl_factor=1.5, min_prefill_chunk=64)
    for start in (64, 128, 192):
        head = Request("p", list(range(3, 259)), SamplingParams())
        head.num_computed_tokens = start
        sizer = ChunkSizer(cfg, 2048, cost, block_size=16)
        for _ in range(12):
            budget = sizer.prefill_budget(decodes, [head])
        assert budget >= 64, (start, budget, decode_only)
