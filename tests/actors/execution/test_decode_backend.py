"""Which decode-attention and KV-store kernels the engine picks (no GPU needed: the choice
only installs functions on the model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from structlog.testing import capture_logs

from tokenloom.config.schema import ConfigError
from tokenloom.kernels.device import select_decode_backend

pytest.importorskip("triton")


class FakeModel:
    def __init__(self, head_dim: int):
        self.spec = SimpleNamespace(head_dim=head_dim, max_position_embeddings=4096,
                                    num_heads=4, num_kv_heads=2, hidden_size=64,
                                    intermediate_size=128)
        self.embed_tokens = SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16))
        self.decode_fn = self.store_fn = self.fused = None

    def set_decode_kernel(self, fn):
        self.decode_fn = fn

    def set_kv_store_kernel(self, fn):
        self.store_fn = fn

    def set_fused_kernels(self, *fns):
        self.fused = fns


CUDA = torch.device("cuda")


def test_auto_on_cuda_picks_triton_split_by_the_sm_count(monkeypatch):
    from tokenloom.kernels.gpu import triton_attention as ta
    from tokenloom.kernels.gpu.decode_split import SplitRule
    from tokenloom.kernels.gpu.triton_attention import SplitDecode, store_kv_triton

    monkeypatch.setattr(ta, "sm_count", lambda: 132)
    m = FakeModel(128)
    assert select_decode_backend(m, "auto", CUDA, max_model_len=131072) == "triton"
    from tokenloom.kernels.gpu import triton_fused as tf

    # The split is sized per step from the model's heads and the GPU, not max_model_len.
    assert isinstance(m.decode_fn, SplitDecode)
    assert m.decode_fn.rule == SplitRule(heads=4, kv_heads=2, head_dim=128, sm_count=132)
    assert m.store_fn is store_kv_triton
    assert m.fused == (tf.rms_norm_triton, tf.silu_mul_triton, tf.rope_store_triton)


def test_a_failing_smoke_test_drops_every_triton_kernel(monkeypatch):
    """The smoke test runs on the GPU in the model's dtype and shapes; when any kernel fails
    it, graphs and eager both keep the torch reference (no KV store kernel: no graphs)."""
    from tokenloom.kernels.gpu import triton_fused as tf

    seen = {}

    def failing(device, dtype, **shapes):
        seen.update(shapes, dtype=dtype)
        return "the Triton decode attention kernel failed: CompilationError: bf16 dot"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tf, "smoke_test", failing)
    m = FakeModel(128)
    with capture_logs() as events:
        assert select_decode_backend(m, "auto", CUDA, max_model_len=8192, block_size=32) == "torch"
    assert m.decode_fn is None and m.store_fn is None and m.fused is None
    assert seen["dtype"] == torch.bfloat16 and seen["head_dim"] == 128
    assert seen["block_size"] == 32 and seen["partition"] == 64
    [event] = events
    assert event["log_level"] == "warning" and "bf16 dot" in event["reason"]
    assert "Triton kernels off" in event["event"]


def test_torch_on_cuda_keeps_the_reference_but_a_graph_safe_store():
    m = FakeModel(64)
    assert select_decode_backend(m, "torch", CUDA) == "torch"
    assert m.decode_fn is None and m.store_fn is not None and m.fused is not None


def test_unsupported_head_dim_falls_back_with_a_reason():
    m = FakeModel(80)
    with capture_logs() as events:
        assert select_decode_backend(m, "auto", CUDA) == "torch"
    assert m.decode_fn is None and m.fused[2] is None   # no RoPE kernel for head dim 80
    [event] = events
    assert event["logger_name"] == "tokenloom.startup" and event["log_level"] == "info"
    assert event["event"].startswith("decode attention: torch reference")
    assert "head dim 80" in event["event"] and "head dim 80" in event["reason"]


def test_backend_device_mismatches_are_config_errors():
    with pytest.raises(ConfigError, match="'triton' needs model.device cuda"):
        select_decode_backend(FakeModel(64), "triton", torch.device("cpu"))
    with pytest.raises(ConfigError, match="'cpu_kernel' needs model.device cpu"):
        select_decode_backend(FakeModel(64), "cpu_kernel", CUDA)
