"""Capture sizes, the padded-size table, histogram-derived buckets and padding waste (pure)."""

from __future__ import annotations

import itertools
import random

import pytest

from tokenloom.graphs.buckets import (
    PaddedSizeTable,
    capture_sizes,
    default_capture_sizes,
    padding_waste,
    sizes_from_histogram,
)


def test_default_series():
    assert default_capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(5) == (1, 2, 4, 5)       # the cap itself is always a bucket
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_capture_sizes(256)[-3:] == (240, 248, 256)


def test_capture_sizes_from_config():
    assert capture_sizes(64) == default_capture_sizes(64)
    assert capture_sizes(64, max_size=16) == (1, 2, 4, 8, 16)
    assert capture_sizes(8, max_size=512) == (1, 2, 4, 8)   # never above max_num_seqs
    assert capture_sizes(64, explicit=[32, 1, 8, 8, 128]) == (1, 8, 32)
    with pytest.raises(ValueError, match="no capture size"):
        capture_sizes(4, explicit=[8, 16])
    with pytest.raises(ValueError):
        default_capture_sizes(0)


def test_padded_size_table_is_smallest_bucket_at_least_n():
    sizes = (1, 2, 4, 8, 16, 24, 32)
    table = PaddedSizeTable(sizes)
    for n in range(1, 33):
        assert table.padded(n) == min(s for s in sizes if s >= n)
    assert table.padded(33) is None
    assert table.padded(1000) is None
    assert table.as_dict()[17] == 24
    with pytest.raises(ValueError):
        table.padded(0)


def test_padding_waste_accounting():
    hist = {1: 10, 3: 5, 5: 2, 40: 1}
    w = padding_waste(hist, (1, 4, 8, 32))
    assert w.real_rows == 10 + 15 + 10
    assert w.padded_rows == 0 + 5 * 1 + 2 * 3
    assert w.eager_rows == 40
    assert w.fraction == pytest.approx(11 / 46)


def _brute_force(hist, k, max_size):
    points = sorted(set(hist) | {max_size})
    best = None
    for r in range(1, k + 1):
        for combo in itertools.combinations(points[:-1], r - 1):
            sizes = combo + (max_size,)
            cost = padding_waste(hist, sizes).padded_rows
            if best is None or cost < best:
                best = cost
    return best


def test_histogram_buckets_are_optimal():
    rng = random.Random(0)
    for _ in range(30):
        max_size = rng.randint(4, 40)
        hist = {rng.randint(1, max_size): rng.randint(1, 50) for _ in range(rng.randint(1, 7))}
        k = rng.randint(1, 4)
        sizes = sizes_from_histogram(hist, k, max_size)
        assert len(sizes) <= k and sizes[-1] == max_size
        assert padding_waste(hist, sizes).padded_rows == _brute_force(hist, k, max_size)


def test_histogram_buckets_beat_the_default_series():
    # Traffic that sits just above the default buckets (9, 17, 25 sequences).
    hist = {9: 100, 17: 100, 25: 100, 3: 10}
    derived = sizes_from_histogram(hist, max_graphs=5, max_size=32)
    assert padding_waste(hist, derived).padded_rows < padding_waste(
        hist, default_capture_sizes(32)).padded_rows
    assert {9, 17, 25, 32} <= set(derived)
    assert capture_sizes(32, histogram=hist, max_graphs=5) == derived


def test_histogram_ignores_out_of_range_sizes_and_keeps_the_cap():
    assert sizes_from_histogram({100: 5, 0: 3}, 4, 16) == (16,)
    assert sizes_from_histogram({}, 4, 8) == (8,)
