"""The CUDA path's run-ahead, exercised on CPU: the runner launches step N+1 before it
finishes step N, feeding N's sampled ids into N+1's placeholders on the device.

On CPU run-ahead is off by default (a CPU launch computes the whole forward, so finishing
first is sooner); forcing it on runs the same bookkeeping a GPU would. Outputs must equal
the serial loop's token for token: greedy, seeded sampling (which may run ahead) and
penalties/logprobs (which must not: their step waits for the previous tokens on the host).
"""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams

from tinymodel import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-run-ahead")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2), seed=5)
    return path


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=3, logprobs=2, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0, min_tokens=5, max_tokens=24),
]
PROMPTS = [[5 + (i * 13 + k) % 200 for k in range(6 + 3 * i)] for i in range(len(PARAMS))]


def _run(model_dir, tmp_path, overlap: bool, run_ahead: bool):
    llm = LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
              cache_dir=str(tmp_path), block_size=8, overlap=overlap,
              max_num_batched_tokens=32, max_num_seqs=8)
    llm.engine.runner.run_ahead = run_ahead
    try:
        outs = llm.generate(PROMPTS, PARAMS)
        llm.wait_for_idle()
        llm.check_integrity()
        return [(o.token_ids, o.outputs[0].logprobs) for o in outs]
    finally:
        llm.close()


def test_run_ahead_matches_the_serial_loop(model_dir, tmp_path):
    serial = _run(model_dir, tmp_path, overlap=False, run_ahead=False)
    ahead = _run(model_dir, tmp_path, overlap=True, run_ahead=True)
    for i, (s, a) in enumerate(zip(serial, ahead)):
        assert a[0] == s[0], f"request {i} ({PARAMS[i]}) diverged with run-ahead"
    # Logprobs too: the same tokens and alternatives; values equal up to the rounding that
    # differs with batch composition (which steps ran together).
    for a, b in zip(ahead[3][1], serial[3][1]):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
