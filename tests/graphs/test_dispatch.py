"""The single graph-or-eager decision (pure)."""

from __future__ import annotations

from tokenloom.graphs.buckets import PaddedSizeTable
from tokenloom.graphs.dispatch import EAGER, GRAPH, Dispatcher


def test_decode_batches_up_to_the_largest_bucket_replay_padded():
    d = Dispatcher(PaddedSizeTable((1, 2, 4, 8)))
    assert d.decide(1, 1, 1) == d.decide(1, 1, 1)
    assert (d.decide(1, 1, 1).mode, d.decide(1, 1, 1).padded_size) == (GRAPH, 1)
    assert (d.decide(3, 3, 3).mode, d.decide(3, 3, 3).padded_size) == (GRAPH, 4)
    assert d.decide(8, 8, 8).padded_size == 8


def test_prefill_mixed_and_large_batches_run_eager():
    d = Dispatcher(PaddedSizeTable((1, 2, 4, 8)))
    assert d.decide(1, 0, 100).mode == EAGER                 # prefill only
    assert d.decide(3, 2, 40).reason == "prefill in batch"   # mixed
    assert d.decide(9, 9, 9).mode == EAGER                   # above the largest bucket
    assert d.decide(9, 9, 9).padded_size == 9


def test_disabled_dispatcher_is_always_eager_with_its_reason():
    d = Dispatcher(None, "graphs.enforce_eager")
    dec = d.decide(2, 2, 2)
    assert dec.mode == EAGER and dec.reason == "graphs.enforce_eager"


def test_stats_count_padding_waste_and_histogram():
    d = Dispatcher(PaddedSizeTable((1, 4, 8)))
    for n in (3, 3, 5, 1):
        d.dispatch(n, n, n)
    d.dispatch(2, 1, 30)   # mixed
    d.dispatch(12, 12, 12)
    s = d.stats()
    assert s["graph_steps"] == 4 and s["eager_steps"] == 2
    assert s["graph_real_rows"] == 12 and s["graph_padded_rows"] == 1 + 1 + 3
    assert s["padding_waste_fraction"] == 5 / 17
    assert s["decode_batch_size_histogram"] == {"1": 1, "3": 2, "5": 1, "12": 1}
    assert s["eager_reasons"] == {"prefill in batch": 1, "larger than the largest bucket": 1}
