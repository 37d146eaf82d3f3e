"""The scheduler counts the iterations in which the KV plan held the first waiting request
back (`SchedulerStats.num_kv_plan_waits`, /metrics `tokenloom:kv_plan_waits`): none when the
pool is ample, some when it is small, and the same greedy output either way."""

from __future__ import annotations

import pytest
from tinymodel import build_tiny_model

from tokenloom import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv-waits")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2), seed=7)
    return path


def _run(model_dir, tmp_path, num_blocks):
    prompts = [[5 + (i * 11 + k) % 150 for k in range(24)] for i in range(6)]
    with LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
             cache_dir=str(tmp_path), block_size=8, num_blocks=num_blocks,
             max_num_seqs=6) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                    ignore_eos=True))
        return [o.token_ids for o in outs], llm.scheduler_stats().num_kv_plan_waits


def test_kv_plan_waits_are_counted_under_pool_pressure(model_dir, tmp_path):
    ample, waits_ample = _run(model_dir, tmp_path, 512)
    small, waits_small = _run(model_dir, tmp_path, 16)   # room for ~2 requests at a time
    assert waits_ample == 0
    assert waits_small > 0
    assert small == ample
