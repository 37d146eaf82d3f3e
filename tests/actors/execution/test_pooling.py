"""The runner's pooling (actors/execution/pooling.py) on a stand-in model whose final norm
doubles its input: last-token, mean and CLS pooling over chunked prompts give the vectors of
the whole prompt; positions summed before a preemption are not summed twice; a gap (a
prefix hit that skipped positions) is an error; other requests in the batch are left out."""

from __future__ import annotations

import types

import pytest
import torch

from tokenloom.actors.execution.pooling import Pooler
from tokenloom.actors.messages import ExecuteBatch, ScheduledSequence
from tokenloom.actors.sampling_params import SamplingParams

H = 4
MODEL = types.SimpleNamespace(norm=lambda x: 2 * x)


def state(prompt_len: int, pooling: str | None):
    row = types.SimpleNamespace(prompt_token_ids=list(range(prompt_len)),
                                params=SamplingParams(max_tokens=1, pooling=pooling))
    return types.SimpleNamespace(row=row)


def step(pooler, seqs, chunks, hidden):
    """chunks: (request, start, n); hidden: that request's full prompt states [P, H]."""
    sequences, rows = [], []
    for rid, start, n in chunks:
        sequences.append(ScheduledSequence(request_id=rid, token_ids=[0] * n, start_pos=start,
                                           block_table=[], sample=True))
        rows.append(hidden[rid][start:start + n])
    batch = ExecuteBatch(step=0, sequences=sequences, num_decodes=0)
    pooler.collect(MODEL, torch.cat(rows), batch, seqs)
    return dict(pooler.take())


@pytest.fixture
def hidden():
    torch.manual_seed(0)
    return {"a": torch.randn(10, H), "b": torch.randn(10, H), "x": torch.randn(10, H)}


@pytest.mark.parametrize("kind, expect", [
    ("last", lambda h: 2 * h[-1]), ("mean", lambda h: 2 * h.mean(0)), ("cls", lambda h: 2 * h[0]),
])
def test_chunked_prompts_pool_to_the_whole_prompts_vector(kind, expect, hidden):
    pooler = Pooler()
    seqs = {"a": state(10, kind), "x": state(10, None)}
    assert step(pooler, seqs, [("x", 0, 4), ("a", 0, 4)], hidden) == {}
    assert step(pooler, seqs, [("a", 4, 3)], hidden) == {}
    done = step(pooler, seqs, [("a", 7, 3), ("x", 4, 6)], hidden)
    assert set(done) == {"a"}
    torch.testing.assert_close(done["a"], expect(hidden["a"]))


def test_positions_summed_before_a_preemption_count_once(hidden):
    pooler = Pooler()
    seqs = {"b": state(10, "mean")}
    step(pooler, seqs, [("b", 0, 6)], hidden)
    # Preempted, readmitted from its own cached blocks (positions 0..3), recomputed from 4.
    done = step(pooler, seqs, [("b", 4, 6)], hidden)
    torch.testing.assert_close(done["b"], 2 * hidden["b"].mean(0))


def test_a_gap_is_an_error_and_forget_drops_the_sum(hidden):
    pooler = Pooler()
    seqs = {"b": state(10, "mean")}
    done = step(pooler, seqs, [("b", 2, 8)], hidden)
    assert "positions 0..1" in done["b"]
    [msg] = Pooler.messages([("b", done["b"])])
    assert msg.error and msg.data == []
    step(pooler, seqs, [("b", 0, 4)], hidden)
    pooler.forget("b")
    assert "positions 0..3" in step(pooler, seqs, [("b", 4, 6)], hidden)["b"]
