"""Start-up compiles every Triton decode-attention variant the server can meet
(graphs/setup.precompile_decode); the launcher is replaced, so no GPU is needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

pytest.importorskip("triton")

from tokenloom.graphs.setup import precompile_decode  # noqa: E402
from tokenloom.kernels.gpu import triton_attention as ta  # noqa: E402
from tokenloom.kernels.gpu.decode_split import SplitRule, Variant  # noqa: E402
from tokenloom.kernels.kv_store import KVCache  # noqa: E402

BS = 16


class FakeModel:
    def __init__(self, decode_fn):
        self.layers = [SimpleNamespace(self_attn=SimpleNamespace(decode_fn=decode_fn))]

    def set_decode_kernel(self, fn):
        self.layers[0].self_attn.decode_fn = fn


def _setup(monkeypatch, sm_count=24, fail=False):
    launched = []

    def launch(q, kc, vc, tables, lens, scale, partition, num_parts, block_n):
        if fail and partition == 128:
            raise RuntimeError("ptxas: out of registers")
        launched.append((Variant(partition, num_parts == 1), q.dtype, kc.shape[1:], num_parts))
        return torch.empty_like(q)

    monkeypatch.setattr(ta, "_launch", launch)
    split = ta.SplitDecode(SplitRule(heads=6, kv_heads=2, head_dim=32, sm_count=sm_count,
                                     scratch_bytes=1 << 16, max_partitions=24))
    kv = KVCache.allocate(1, 4, BS, 2, 32, torch.bfloat16, "cpu")
    return split, FakeModel(split), kv, launched


def test_every_variant_the_rule_can_pick_is_launched_once(monkeypatch):
    split, model, kv, launched = _setup(monkeypatch)
    max_rows, width, sizes = 12, 50 * BS, (1, 2, 4, 8)
    with capture_logs() as events:
        precompile_decode(model, kv, max_num_seqs=max_rows, width=width, graph_sizes=sizes)
    # What eager steps (every rows x context) and the captured buckets can call...
    reachable = {split.variant(r, c, capturing=False)
                 for r in range(1, max_rows + 1) for c in range(1, width + 1)}
    reachable |= {split.variant(r, width, capturing=True) for r in sizes}
    # ...is exactly what was compiled, each once, in the model's dtype and cache shape.
    assert [v for v, *_ in launched] == sorted(reachable, key=lambda v: (v.partition, v.direct))
    assert all(dt == torch.bfloat16 and shape == (BS, 2, 32) for _, dt, shape, _ in launched)
    assert all(n == (1 if v.direct else 2) for v, _, _, n in launched)
    assert any(v.direct for v in reachable) and any(not v.direct for v in reachable)
    [event] = events
    assert f"{len(reachable)} Triton variants compiled" in event["event"]
    assert event["variants"] == len(reachable) and model.layers[0].self_attn.decode_fn is split


def test_a_failing_variant_falls_back_to_the_reference(monkeypatch):
    split, model, kv, _ = _setup(monkeypatch, fail=True)
    with capture_logs() as events:
        precompile_decode(model, kv, max_num_seqs=12, width=50 * BS, graph_sizes=())
    assert model.layers[0].self_attn.decode_fn is None
    [event] = events
    assert event["log_level"] == "warning" and "out of registers" in event["reason"]


def test_other_decode_kernels_are_left_alone(monkeypatch):
    _, _, kv, launched = _setup(monkeypatch)
    model = FakeModel(None)
    precompile_decode(model, kv, max_num_seqs=4, width=64, graph_sizes=(1,))
    assert launched == [] and model.layers[0].self_attn.decode_fn is None


def test_a_capture_compiles_its_graph_variant_first(monkeypatch):
    """DecodeGraphs.capture_one warms up eagerly (the eager split), so the graph's own
    variant is compiled by prepare_capture before the stream capture starts."""
    split, _, kv, launched = _setup(monkeypatch)
    split.prepare_capture(4, 50 * BS, kv)
    assert [v for v, *_ in launched] == [split.variant(4, 50 * BS, capturing=True)]
