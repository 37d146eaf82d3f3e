"""A runner exception in step N fails only the requests of step N; the engine goes on.

Scenario, with overlapped steps and with the serial loop (a fault injected into the CPU
forward of the request's third step):
1. max_num_seqs=1: request A runs, B waits behind it (B is in no step while A fails);
2. A's third step raises: A ends with finish_reason "error" and the exception's message,
   its blocks return, the runner drops its state — under overlap the step after N, planned
   before the failure was known, skips A instead of failing too;
3. B then runs to the end with the same tokens as when run alone;
4. the pool is intact and idle, and a later request is served normally.
"""

from __future__ import annotations

import threading

import pytest
from tinymodel import build_tiny_model

from tokenloom import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-faults")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2), seed=3)
    return path


class Fault:
    """Wraps ModelRunner._forward: raises on the `at`-th step containing `request_id`."""

    def __init__(self, model_runner, request_id: str, at: int):
        self.calls = 0
        self.fired = threading.Event()
        inner = model_runner._forward

        def forward(batch, patch):
            if any(s.request_id == request_id for s in batch.sequences):
                self.calls += 1
                if self.calls == at:
                    self.fired.set()
                    raise RuntimeError("injected fault")
            return inner(batch, patch)

        model_runner._forward = forward


@pytest.mark.parametrize("overlap,run_ahead", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "serial", "run-ahead"])
def test_a_failed_step_ends_only_its_requests(model_dir, tmp_path, overlap, run_ahead):
    """run-ahead: the CUDA path's launch-before-finish, forced on CPU (test_run_ahead.py)."""
    llm = LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
              cache_dir=str(tmp_path), block_size=8, max_num_seqs=1, overlap=overlap)
    llm.engine.runner.run_ahead = run_ahead
    try:
        a, b = [5, 6, 7, 8, 9], [40, 41, 42]
        alone = llm.generate([b], GREEDY)[0].token_ids
        fault = Fault(llm.engine.runner.model_runner, request_id="req-1", at=3)  # A is req-1
        out_a, out_b = llm.generate([a, b], GREEDY)
        assert fault.fired.is_set()
        assert out_a.finish_reason == "error" and "injected fault" in out_a.outputs[0].error
        assert out_b.finish_reason == "length" and out_b.token_ids == alone
        stats = llm.wait_for_idle()
        assert stats.used == 0
        llm.check_integrity()
        assert llm.generate([b], GREEDY)[0].token_ids == alone
        tracked = llm._wait(llm.engine.ask(llm.engine.runner, _runner_state()))
        assert tracked.num_tracked == 0   # finished requests' sampling state is dropped
    finally:
        llm.close()


def _runner_state():
    from tokenloom.actors.messages import GetRunnerState
    return GetRunnerState()
