"""The decode-attention split rule (kernels/gpu/decode_split.py): pure sizing, no GPU."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.arith import cdiv
from tokenloom.kernels.gpu.decode_split import PROGRAMS_PER_SM, SplitRule, Variant

H200 = dict(sm_count=132)
LLAMA_8B = dict(heads=32, kv_heads=8, head_dim=128)

rules = st.builds(
    SplitRule,
    heads=st.sampled_from([1, 4, 9, 32]).flatmap(lambda h: st.just(h)),
    kv_heads=st.just(1),
    head_dim=st.sampled_from([16, 64, 128]),
    sm_count=st.integers(1, 160),
    block_n=st.sampled_from([16, 64, 128]),
    scratch_bytes=st.integers(1 << 12, 1 << 28),
    max_partitions=st.integers(1, 2048),
    reference_context=st.integers(1, 8192),
)


def _parts(context: int, v: Variant) -> int:
    return cdiv(context, v.partition)


def _check(rule: SplitRule, rows: int, v: Variant, cover: int) -> None:
    parts = _parts(cover, v)
    assert v.partition >= rule.block_n and v.partition & (v.partition - 1) == 0
    assert v.direct == (parts == 1)
    # Scratch within its bound (a single partition writes the output, no scratch).
    assert parts == 1 or rows * rule.heads * parts * (rule.head_dim + 1) * 4 <= rule.scratch_bytes
    assert parts <= rule.max_partitions or parts == 1


@settings(max_examples=300, deadline=None)
@given(rule=rules, rows=st.integers(1, 512), context=st.integers(1, 1 << 17))
def test_eager_partition_properties(rule, rows, context):
    v = rule.eager(rows, context)
    _check(rule, rows, v, context)
    # Enough programs: the target where the context and the scratch bound allow it.
    per_row = cdiv(PROGRAMS_PER_SM * rule.sm_count, rows * rule.kv_heads)
    assert _parts(context, v) >= min(per_row, context // rule.block_n,
                                     rule.max_parts(rows) // 2 + 1)
    assert v.direct or per_row > 1     # rows that fill the GPU alone skip the reduce


@settings(max_examples=300, deadline=None)
@given(rule=rules, rows=st.integers(1, 512), width=st.integers(1, 1 << 17))
def test_graph_partition_covers_the_width_and_keeps_short_contexts_busy(rule, rows, width):
    v = rule.graph(rows, width)
    _check(rule, rows, v, width)     # the grid covers the whole width within the bound
    # Sized like an eager step at the reference context, larger only where covering the
    # width within the scratch bound forces it.
    short = rule.eager(rows, min(width, rule.reference_context))
    assert v.partition >= short.partition
    assert v.partition == short.partition or _parts(width, Variant(v.partition // 2, False)) > \
        rule.max_parts(rows)


def test_h200_batch_one_under_2k_context_fills_the_sms():
    """The case from issue #13: a 128k model used 2048-token partitions (8 programs)."""
    rule = SplitRule(**LLAMA_8B, **H200)
    target = PROGRAMS_PER_SM * 132
    assert _parts(2000, rule.eager(1, 2000)) == 32    # 64-token partitions: 256 programs
    for context in (4096, 8192, 131072):
        v = rule.eager(1, context)
        assert 8 * _parts(context, v) >= target, (context, v)
    # A graph captured at the full 128k width: its grid (<= max_partitions per row, most
    # exiting at once) gives 2k contexts 16x the old 8 programs and 8k ones the target.
    v = rule.graph(1, 131072)
    assert _parts(131072, v) <= rule.max_partitions
    assert 8 * _parts(2048, v) == 128 and 8 * _parts(8192, v) >= target
    # Many rows: one partition per row already fills the GPU, so no reduce.
    assert rule.eager(64, 4096).direct and rule.eager(64, 5000).direct


@settings(max_examples=60, deadline=None)
@given(sm_count=st.integers(1, 40), kv_heads=st.integers(1, 4), max_rows=st.integers(1, 12),
       max_context=st.integers(1, 700), scratch=st.integers(1 << 10, 1 << 16),
       max_partitions=st.integers(1, 40))
def test_enumerated_variants_are_exactly_those_the_rule_picks(sm_count, kv_heads, max_rows,
                                                             max_context, scratch,
                                                             max_partitions):
    rule = SplitRule(heads=2 * kv_heads, kv_heads=kv_heads, head_dim=16, sm_count=sm_count,
                     block_n=16, scratch_bytes=scratch, max_partitions=max_partitions)
    brute = {rule.eager(r, c) for r in range(1, max_rows + 1) for c in range(1, max_context + 1)}
    assert rule.eager_variants(max_rows, max_context) == brute


def test_rule_fields_are_checked():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        SplitRule(**LLAMA_8B, **H200, block_n=48)
    with pytest.raises(ValueError, match="sm_count must be >= 1"):
        SplitRule(**LLAMA_8B, sm_count=0)
