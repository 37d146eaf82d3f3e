"""The start-up warm-up request (daemon/app.warm_up) decodes, so the decode path has run
before the server says ready."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tokenloom.daemon.app import warm_up


class FakeEngine:
    def __init__(self, finish_reason="length"):
        self.tokenizer = SimpleNamespace(bos_token_id=7)
        self.requests = []
        self.finish_reason = finish_reason

    async def generate(self, req):
        self.requests.append(req)
        yield SimpleNamespace(finished=True, finish_reason=self.finish_reason, error="boom")


def test_warm_up_runs_a_prefill_and_at_least_one_decode_step():
    engine = FakeEngine()
    asyncio.run(warm_up(engine))
    [req] = engine.requests
    p = req.sampling_params
    # One prompt token is the prefill; a second generated token needs a decode step, which
    # an early EOS must not skip.
    assert req.prompt_token_ids == [7] and p.max_tokens >= 2 and p.ignore_eos
    assert p.temperature == 0.0


def test_a_failing_warm_up_stops_start_up():
    with pytest.raises(RuntimeError, match="warm-up failed: boom"):
        asyncio.run(warm_up(FakeEngine(finish_reason="error")))
