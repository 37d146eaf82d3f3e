"""Which decode-attention and KV-store kernels the engine picks (no GPU needed: the choice
only installs functions on the model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

from tokenloom.kernels.device import select_decode_backend
from tokenloom.config.schema import ConfigError

pytest.importorskip("triton")


class FakeModel:
    def __init__(self, head_dim: int):
        self.spec = SimpleNamespace(head_dim=head_dim, max_position_embeddings=4096)
        self.decode_fn = self.store_fn = None

    def set_decode_kernel(self, fn):
        self.decode_fn = fn

    def set_kv_store_kernel(self, fn):
        self.store_fn = fn


CUDA = torch.device("cuda")


def test_auto_on_cuda_picks_triton_with_partition_for_the_context():
    from tokenloom.kernels.triton_attention import paged_decode_triton, store_kv_triton

    m = FakeModel(128)
    assert select_decode_backend(m, "auto", CUDA, max_model_len=131072) == "triton"
    assert m.decode_fn.func is paged_decode_triton and m.decode_fn.keywords["partition"] == 2048
    assert m.store_fn is store_kv_triton


def test_torch_on_cuda_keeps_the_reference_but_a_graph_safe_store():
    m = FakeModel(64)
    assert select_decode_backend(m, "torch", CUDA) == "torch"
    assert m.decode_fn is None and m.store_fn is not None


def test_unsupported_head_dim_falls_back_with_a_reason():
    m = FakeModel(80)
    with capture_logs() as events:
        assert select_decode_backend(m, "auto", CUDA) == "torch"
    assert m.decode_fn is None
    [event] = events
    assert event["logger_name"] == "tokenloom.startup" and event["log_level"] == "info"
    assert event["event"].startswith("decode attention: torch reference")
    assert "head dim 80" in event["event"] and "head dim 80" in event["reason"]


def test_backend_device_mismatches_are_config_errors():
    with pytest.raises(ConfigError, match="'triton' needs model.device cuda"):
        select_decode_backend(FakeModel(64), "triton", torch.device("cpu"))
    with pytest.raises(ConfigError, match="'cpu_kernel' needs model.device cpu"):
        select_decode_backend(FakeModel(64), "cpu_kernel", CUDA)
