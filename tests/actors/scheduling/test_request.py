"""Request: the lifecycle state machine, progress derived from token counts, and check_stop.

Pure: no torch, no asyncio.
"""

from __future__ import annotations

import itertools

import pytest

from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.actors.scheduling.request import (
    ALLOWED_TRANSITIONS,
    FinishReason,
    IllegalTransition,
    Request,
    RequestStatus,
)

S = RequestStatus
EOS = 2

# The expected edges, written out independently of ALLOWED_TRANSITIONS so that a change to the
# table has to be made in two places on purpose. The seed's chain WAITING_PREFILL -> PREFILLING
# -> WAITING_DECODE -> DECODING, with these shortcuts the scheduler needs:
#   WAITING_PREFILL -> FINISHED   a request rejected before it runs (too large for the pool)
#   PREFILLING -> FINISHED        the first sampled token already ends it (max_tokens=1, EOS)
#   * -> CANCELLED                an abort, from any live state
#   running states -> PREEMPTED -> WAITING_PREFILL   recompute preemption
# FINISHED and CANCELLED are terminal.
EXPECTED_EDGES = {
    (S.WAITING_PREFILL, S.PREFILLING),
    (S.WAITING_PREFILL, S.FINISHED),
    (S.WAITING_PREFILL, S.CANCELLED),
    (S.PREFILLING, S.WAITING_DECODE),
    (S.PREFILLING, S.FINISHED),
    (S.PREFILLING, S.CANCELLED),
    (S.PREFILLING, S.PREEMPTED),
    (S.WAITING_DECODE, S.DECODING),
    (S.WAITING_DECODE, S.FINISHED),
    (S.WAITING_DECODE, S.CANCELLED),
    (S.WAITING_DECODE, S.PREEMPTED),
    (S.DECODING, S.FINISHED),
    (S.DECODING, S.CANCELLED),
    (S.DECODING, S.PREEMPTED),
    (S.PREEMPTED, S.WAITING_PREFILL),
    (S.PREEMPTED, S.CANCELLED),
}
ALL_PAIRS = list(itertools.product(RequestStatus, RequestStatus))


def make_request(prompt_len: int = 4, eos: tuple[int, ...] = (EOS,), max_model_len=None,
                 rid: str = "r", **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(**params),
                   eos_token_ids=eos, max_model_len=max_model_len)


def at_status(status: RequestStatus) -> Request:
    req = make_request()
    req.status = status  # test set-up only: jump straight to the source state
    return req


# -- the state machine -------------------------------------------------------------------


def test_table_matches_the_expected_edges():
    table_edges = {(src, dst) for src, dsts in ALLOWED_TRANSITIONS.items() for dst in dsts}
    assert table_edges == EXPECTED_EDGES
    assert set(ALLOWED_TRANSITIONS) == set(RequestStatus)


@pytest.mark.parametrize("src,dst", sorted(EXPECTED_EDGES), ids=lambda s: s.name)
def test_allowed_transition_succeeds(src, dst):
    req = at_status(src)
    req.transition(dst)
    assert req.status is dst


@pytest.mark.parametrize("src,dst", [p for p in ALL_PAIRS if p not in EXPECTED_EDGES],
                         ids=lambda s: s.name)
def test_disallowed_transition_raises_and_keeps_status(src, dst):
    req = at_status(src)
    with pytest.raises(IllegalTransition, match=f"{src.name} -> {dst.name}"):
        req.transition(dst)
    assert req.status is src


def test_every_pair_is_covered():
    # 7 states -> 49 ordered pairs (self-loops included, all illegal).
    assert len(ALL_PAIRS) == 49
    assert all((s, s) not in EXPECTED_EDGES for s in RequestStatus)


def test_terminal_states():
    assert [s for s in RequestStatus if s.is_finished] == [S.FINISHED, S.CANCELLED]
    for s in (S.FINISHED, S.CANCELLED):
        assert at_status(s).is_finished
        assert not ALLOWED_TRANSITIONS[s]
    for s in (S.WAITING_PREFILL, S.PREFILLING, S.WAITING_DECODE, S.DECODING, S.PREEMPTED):
        assert not at_status(s).is_finished


def test_full_lifecycle_with_a_preemption():
    req = make_request()
    assert req.status is S.WAITING_PREFILL
    for s in (S.PREFILLING, S.WAITING_DECODE, S.DECODING, S.PREEMPTED, S.WAITING_PREFILL,
              S.PREFILLING, S.WAITING_DECODE, S.DECODING, S.FINISHED):
        req.transition(s)
    assert req.is_finished


def test_illegal_transition_is_a_runtime_error():
    # Callers that catch RuntimeError (the actor loop) see it; it is never swallowed as OK.
    assert issubclass(IllegalTransition, RuntimeError)


# -- progress from token counts ----------------------------------------------------------


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError):
        Request("r", [], SamplingParams())


def test_progress_through_chunked_prefill_then_decode():
    req = make_request(prompt_len=10)
    assert (req.num_tokens, req.num_prompt_tokens, req.num_output_tokens) == (10, 10, 0)
    assert req.output_token_ids == []
    assert req.num_remaining_tokens == 10
    assert not req.is_decode

    req.num_computed_tokens = 6  # first chunk
    assert req.num_remaining_tokens == 4
    assert not req.is_decode
    req.num_computed_tokens = 9
    # One prompt token left is still prefill: it has no output yet.
    assert req.num_remaining_tokens == 1
    assert not req.is_decode

    req.num_computed_tokens = 10
    req.append_token(7, now=1.0)
    assert req.num_remaining_tokens == 1
    assert req.is_decode
    assert (req.num_tokens, req.num_output_tokens, req.output_token_ids) == (11, 1, [7])

    req.num_computed_tokens = 11
    req.append_token(8, now=2.0)
    assert req.output_token_ids == [7, 8]
    assert req.token_ids[:10] == list(range(100, 110))
    assert req.first_token_time == 1.0
    assert req.token_times == [1.0, 2.0]


def test_single_token_prompt():
    req = make_request(prompt_len=1)
    assert req.num_remaining_tokens == 1 and not req.is_decode
    req.num_computed_tokens = 1
    req.append_token(5, now=0.0)
    assert req.is_decode


def test_preempted_request_recomputes_prompt_and_outputs_as_a_prefill():
    req = make_request(prompt_len=4)
    req.num_computed_tokens = 4
    req.append_token(7, now=0.0)
    req.num_computed_tokens = 5
    req.append_token(8, now=0.0)
    assert req.is_decode
    req.num_computed_tokens = 0  # what preemption does
    assert req.num_remaining_tokens == 6
    assert not req.is_decode
    assert req.output_token_ids == [7, 8]
    assert req.num_prompt_tokens == 4


def test_output_token_ids_is_a_copy():
    req = make_request(prompt_len=2)
    req.append_token(3, now=0.0)
    req.output_token_ids.append(99)
    assert req.output_token_ids == [3]


# -- check_stop -----------------------------------------------------------------------------


def generate(req: Request, tokens) -> list[FinishReason | None]:
    reasons = []
    for t in tokens:
        req.append_token(t, now=0.0)
        reasons.append(req.check_stop())
    return reasons


def test_eos_stops():
    req = make_request()
    assert generate(req, [5, 6, EOS]) == [None, None, FinishReason.STOP]


def test_any_of_several_eos_ids_stops():
    req = make_request(eos=(2, 3))
    assert generate(req, [5, 3]) == [None, FinishReason.STOP]


def test_ignore_eos():
    req = make_request(ignore_eos=True, max_tokens=3)
    assert generate(req, [EOS, EOS, EOS]) == [None, None, FinishReason.LENGTH]


def test_min_tokens_suppresses_eos_and_stop_tokens():
    req = make_request(min_tokens=3, stop_token_ids=(9,))
    assert generate(req, [EOS, 9, 5, EOS]) == [None, None, None, FinishReason.STOP]
    req = make_request(min_tokens=2, stop_token_ids=(9,))
    # The min_tokens-th output token itself may stop.
    assert generate(req, [9, 9]) == [None, FinishReason.STOP]


def test_stop_token_ids_stop_even_with_ignore_eos():
    req = make_request(stop_token_ids=(9, 10), ignore_eos=True)
    assert generate(req, [5, EOS, 10]) == [None, None, FinishReason.STOP]


def test_max_tokens():
    req = make_request(max_tokens=2)
    assert generate(req, [5, 6]) == [None, FinishReason.LENGTH]
    req = make_request(max_tokens=1)
    assert generate(req, [5]) == [FinishReason.LENGTH]


def test_stop_wins_over_length_on_the_same_token():
    req = make_request(max_tokens=2)
    assert generate(req, [5, EOS]) == [None, FinishReason.STOP]


def test_max_model_len_counts_prompt_and_output():
    req = make_request(prompt_len=4, max_model_len=6, max_tokens=100)
    assert generate(req, [5, 6]) == [None, FinishReason.LENGTH]
    assert req.num_tokens == 6


def test_max_model_len_ends_even_before_min_tokens():
    # The context window is a hard limit; min_tokens only holds back EOS and stop tokens.
    req = make_request(prompt_len=4, max_model_len=5, min_tokens=3, max_tokens=10)
    assert generate(req, [5]) == [FinishReason.LENGTH]


def test_no_stop_without_a_condition():
    req = make_request(max_tokens=50, eos=())
    assert generate(req, [EOS] * 49) == [None] * 49
    assert generate(req, [EOS]) == [FinishReason.LENGTH]


def test_finish_reason_as_openai():
    assert [r.as_openai() for r in FinishReason] == ["stop", "length", "abort", "error"]
