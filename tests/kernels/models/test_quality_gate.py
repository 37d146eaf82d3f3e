"""The quantized weight modes' quality gate (kernels/models/quality_gate.py,
kernels/models/weights.py) on a tiny model: identical models pass with perfect scores, int8
passes, a coarse quantization fails, a failing mode refuses to start unless forced, and the
verdict is remembered."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tokenloom.config.schema import ConfigError, ModelConfig
from tokenloom.kernels.models import quality_gate, weights
from tokenloom.kernels.models.loader import load_model

from tinymodel import VOCAB, build_tiny_model

IDS = [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(60)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gate-tiny")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=11)
    return path


def _load(path, dtype=torch.float32):
    model, _ = load_model(path, dtype, torch.device("cpu"), 512)
    return model


def _fake_tokenizer():
    class Tok:
        unk_token_id = 0

        def __call__(self, text):
            return {"input_ids": [0] * 40}    # a word-level vocabulary reads no English
    return Tok()


def test_identical_models_agree_fully(tiny_dir):
    ref = _load(tiny_dir)
    ref._layout_done = True
    r = quality_gate.measure(ref, ref, IDS, "same", greedy_tokens=8)
    assert r.agreement == 1.0 and r.mean_kl < 1e-6 and r.greedy_match == 8 and r.passed


def test_int8_passes_and_coarse_rounding_fails(tiny_dir):
    ref = _load(tiny_dir)
    ref._layout_done = True
    int8 = _load(tiny_dir)
    int8.specialize_cpu("int8")
    assert int8.layers[0].mlp.down_proj.storage == "int8"
    good = quality_gate.measure(ref, int8, IDS, "int8", greedy_tokens=8)
    assert good.passed, good.summary()
    coarse = _load(tiny_dir)
    coarse._layout_done = True
    with torch.no_grad():
        for layer in coarse.layers:
            for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                w = lin.weight
                s = w.abs().amax(1, keepdim=True)           # 3 levels: -1, 0, 1 per channel
                w.copy_((w / s).round() * s)
    bad = quality_gate.measure(ref, coarse, IDS, "ternary", greedy_tokens=8)
    assert not bad.passed, bad.summary()
    assert "FAILED" in bad.summary()


def test_held_out_ids_fall_back_for_unreadable_text():
    ids = weights.held_out_ids(_fake_tokenizer(), VOCAB, 50)
    assert len(ids) == 50 and all(3 <= i < VOCAB for i in ids)
    assert ids == weights.held_out_ids(_fake_tokenizer(), VOCAB, 50)   # deterministic


def _failing(mode="int8"):
    return quality_gate.GateResult(mode=mode, positions=10, agreement=0.5, mean_kl=0.9,
                                   p99_kl=2.0, greedy_match=0, greedy_tokens=8)


def test_failing_gate_refuses_to_start_unless_forced(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "run_gate", lambda *a, **k: _failing())
    cfg = ModelConfig(weight_dtype="int8")
    with pytest.raises(weights.QualityGateError, match="model.force_quantized") as e:
        weights.apply_weight_dtype(_load(tiny_dir), tiny_dir, cfg, torch.float32,
                                   torch.device("cpu"), _fake_tokenizer(), "d1", tmp_path)
    assert e.value.key == "model.weight_dtype"
    forced = msgspec.structs.replace(cfg, force_quantized=True)
    r = weights.apply_weight_dtype(_load(tiny_dir), tiny_dir, forced, torch.float32,
                                   torch.device("cpu"), _fake_tokenizer(), "d1", tmp_path)
    assert not r.passed


def test_verdict_is_remembered_per_weights(tiny_dir, tmp_path, monkeypatch):
    # Forced: a random tiny model's near-tied logits may or may not pass; either verdict
    # must be remembered.
    cfg = ModelConfig(weight_dtype="int8", force_quantized=True)
    # The verdict is keyed by the kernels chosen; pin them (timings on a loaded machine
    # could choose others for the second load, which is then rightly measured anew).
    from tokenloom.kernels.cpu import kernel_plan
    pinned = kernel_plan.Plan(((1 << 30, "copy_mkl"),), {})
    monkeypatch.setattr(kernel_plan, "cached_plan", lambda *a, **k: pinned)
    first = weights.apply_weight_dtype(_load(tiny_dir), tiny_dir, cfg, torch.float32,
                                       torch.device("cpu"), _fake_tokenizer(), "d2", tmp_path)
    assert first.positions > 0 and (tmp_path / "quality_gate.json").is_file()

    def must_not_run(*a, **k):
        raise AssertionError("the remembered verdict should have been used")
    monkeypatch.setattr(weights, "run_gate", must_not_run)
    again = weights.apply_weight_dtype(_load(tiny_dir), tiny_dir, cfg, torch.float32,
                                       torch.device("cpu"), _fake_tokenizer(), "d2", tmp_path)
    assert again == first
    with pytest.raises(AssertionError, match="remembered"):   # other weights: measured anew
        weights.apply_weight_dtype(_load(tiny_dir), tiny_dir, cfg, torch.float32,
                                   torch.device("cpu"), _fake_tokenizer(), "d3", tmp_path)


def test_auto_does_nothing_and_int8_needs_cpu(tiny_dir, tmp_path):
    model = _load(tiny_dir)
    assert weights.apply_weight_dtype(model, tiny_dir, ModelConfig(), torch.float32,
                                      torch.device("cpu"), None, "d", tmp_path) is None
    with pytest.raises(ConfigError, match="needs model.device cpu"):
        weights.apply_weight_dtype(model, tiny_dir, ModelConfig(weight_dtype="int8"),
                                   torch.float32, torch.device("cuda"), None, "d", tmp_path)
    with pytest.raises(ConfigError, match="model.weight_dtype must be one of 'auto', 'int8'"):
        ModelConfig(weight_dtype="int4")
