"""Prompt-lookup proposals (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenloom.actors.speculation.ngram import propose_ngram


def test_proposes_what_followed_the_last_occurrence():
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert propose_ngram(tokens, k=3, n_min=2, n_max=3) == [8, 9, 1]


def test_most_recent_occurrence_wins():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert propose_ngram(tokens, k=1, n_min=2, n_max=2) == [20]


def test_longer_ngram_preferred():
    # "3 1 2" occurred followed by 30; the bigram "1 2" occurred later followed by 40.
    tokens = [3, 1, 2, 30, 9, 1, 2, 40, 3, 1, 2]
    assert propose_ngram(tokens, k=1, n_min=2, n_max=3) == [30]
    assert propose_ngram(tokens, k=1, n_min=2, n_max=2) == [40]


def test_no_match_and_short_sequences():
    assert propose_ngram([1, 2, 3, 4], k=4) == []
    assert propose_ngram([7], k=4) == []
    assert propose_ngram([7, 7], k=4, n_min=1, n_max=1) == [7]
    assert propose_ngram([1, 2, 1, 2], k=0) == []


def test_proposal_stops_at_the_end_of_the_sequence():
    assert propose_ngram([1, 2, 3, 1, 2], k=5, n_min=2, n_max=2) == [3, 1, 2]


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 6),
       st.integers(1, 3), st.integers(0, 2))
def test_proposal_is_a_continuation_of_a_real_match(tokens, k, n_min, extra):
    """Whatever it proposes followed an earlier copy of the sequence's last n tokens."""
    n_max = n_min + extra
    got = propose_ngram(tokens, k, n_min, n_max)
    assert len(got) <= k
    if not got:
        for n in range(n_min, min(n_max, len(tokens) - 1) + 1):
            tail = tokens[-n:]
            assert not any(tokens[i:i + n] == tail for i in range(len(tokens) - n)), n
        return
    ok = False
    for n in range(n_min, n_max + 1):
        tail = tokens[-n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tail and tokens[i + n:i + n + len(got)] == got:
                ok = True
    assert ok, (tokens, got)
