"""A quantized KV cache in a running engine (tiny model): the start-up quality gate, the
pool's capacity, serving through prefix hits, chunking and swap without a leaked block,
and the runtime check catching an injected wrong scale (and nothing on a clean run)."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.config.schema import ConfigError
from tokenloom.kernels import kv_quant
from tokenloom.kernels.kv_quant import FORMATS, KVFormat

from tinymodel import build_tiny_model

PROMPTS = [[5 + (i * 13 + k) % 200 for k in range(30 + 7 * i)] for i in range(4)]
SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
NEAR_TIE = 0.25   # nats: where a quantized cache may pick the other token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kvq")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=4), seed=3)
    return path


def _llm(model_dir, tmp_path, **options) -> LLM:
    return LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
               cache_dir=str(tmp_path / "cache"), block_size=8, **options)


def _same_or_near_tie(got, want):
    """Greedy tokens equal, or the first difference is where the reference's top two
    tokens were within NEAR_TIE nats (a quantization-sized nudge flips a near tie; a
    wrong cache diverges at once, by far)."""
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        if g.token_ids == w.token_ids:
            continue
        i = next(i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
        top = w.logprobs[i].top
        assert top[0][1] - top[1][1] < NEAR_TIE, (i, top)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    with _llm(model_dir, tmp_path_factory.mktemp("ref")) as llm:
        return llm.generate(PROMPTS, SP)


@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3"])
def test_serves_through_hits_chunks_and_swap_without_leaking(model_dir, tmp_path, reference,
                                                             mode):
    # (The tiny random model's fp8 fails the start-up gate: forced, to test the mechanics.)
    with _llm(model_dir, tmp_path, kv_dtype=mode, num_blocks=24, max_num_seqs=4,
              force_kv_dtype=True,
              max_num_batched_tokens=32, preemption_mode="swap",
              admission_lookahead_tokens=0, kv_watermark=0.0, kv_resume_watermark=0.0) as llm:
        first = llm.generate(PROMPTS, SP)
        again = llm.generate(PROMPTS, SP)         # prefix hits on the quantized blocks
        if mode == "int8":      # passes its gate: within a near tie of the fp32 cache
            _same_or_near_tie(first, reference)
            _same_or_near_tie(again, reference)
        _same_or_near_tie(again, first)   # and with itself across scheduling paths
        assert sum(o.outputs[0].timings.num_cached_tokens for o in again) > 0
        assert llm.scheduler_stats().num_swap_preemptions > 0
        llm.check_integrity()
        assert llm.kv_stats().used == 0
        stats = llm.engine.runner.kv_quant_snapshot
        assert stats.kv_dtype == mode
        # 4 layers x 2 x 2 kv heads x (16 values + a 4-byte scale)
        assert stats.bytes_per_token == 4 * 2 * 2 * (16 + 4)


def test_pool_capacity_follows_the_quantized_block_bytes(model_dir, tmp_path):
    budget = {"kv_cache_memory_bytes": 4 << 20}
    with _llm(model_dir, tmp_path, **budget) as llm:
        plain = llm.engine.info.num_blocks
    with _llm(model_dir, tmp_path, kv_dtype="int8", kv_check_fraction=0.0, **budget) as llm:
        assert llm.engine.info.num_blocks == (4 << 20) // (8 * 4 * 2 * 2 * 20)
        assert llm.engine.info.num_blocks / plain == pytest.approx(64 / 20, rel=0.01)
    # The runtime check reserves the model-dtype copy of the layers it may promote.
    with _llm(model_dir, tmp_path, kv_dtype="int8", kv_promote_layers=1, **budget) as llm:
        assert llm.engine.info.num_blocks == (4 << 20) // (8 * 4 * 2 * 2 * 20 + 8 * 2 * 2 * 16 * 4)


def test_a_mode_that_fails_its_gate_refuses_to_start_unless_forced(model_dir, tmp_path,
                                                                   monkeypatch):
    # int8 with 5 levels: what a scale off by 25x would leave of the values.
    monkeypatch.setitem(FORMATS, "int8", KVFormat("int8", torch.int8, 2.0, 0))
    with pytest.raises(ConfigError, match="fails its quality gate") as info:
        _llm(model_dir, tmp_path, kv_dtype="int8")
    text = str(info.value)
    assert "cache.kv_dtype 'int8'" in text and "perplexity" in text and "force_kv_dtype" in text
    with _llm(model_dir, tmp_path, kv_dtype="int8", force_kv_dtype=True) as llm:
        assert llm.generate(PROMPTS[:1], SP)[0].outputs[0].token_ids


def test_a_sound_mode_passes_its_gate(model_dir, tmp_path):
    from tokenloom.kernels.models.kv_quality_gate import apply_kv_gate
    with _llm(model_dir, tmp_path, kv_dtype="int8") as llm:
        result = apply_kv_gate(llm.engine.runner.model_runner.model, llm.engine.config.cache,
                               llm.engine.tokenizer, "tiny", torch.float32, None)
    assert result.passed, result.summary()
    assert result.mean_kl < 0.01 and abs(result.ppl_increase) < 0.01


def _corrupt_scales_of(layer: int, factor: float, monkeypatch):
    """Every write to `layer`'s K cache records a scale `factor` times too large: the
    rows read back `factor` times too large (a scale not delivered, mis-indexed...)."""
    store = kv_quant.quantize_into

    def faulty(cache, x, slots):
        store(cache, x, slots)
        if getattr(cache, "faulty", False):
            cache.scale.view(-1, cache.scale.shape[-1])[slots] *= factor
    monkeypatch.setattr(kv_quant, "quantize_into", faulty)
    return layer


def test_runtime_check_catches_a_wrong_scale_and_promotes_the_layer(model_dir, tmp_path,
                                                                    monkeypatch):
    _corrupt_scales_of(2, 1.5, monkeypatch)
    with _llm(model_dir, tmp_path, kv_dtype="int8", kv_check_fraction=0.2,
              force_kv_dtype=True) as llm:
        llm.engine.kv.key[2].faulty = True
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        check = llm.engine.runner.model_runner.kv_check
        s = check.stats
        assert s.alarms > 0 and s.first_alarm_step is not None
        assert s.first_alarm_step <= check.stride, s   # at the first checked step
        assert s.promoted == (2,), s                # that layer, and no other
        assert llm.engine.kv.promoted_layers() == [2]
        assert llm.engine.runner.kv_quant_snapshot.num_promoted_layers == 1
        llm.check_integrity()


def test_runtime_check_raises_no_alarm_on_a_clean_run(model_dir, tmp_path):
    with _llm(model_dir, tmp_path, kv_dtype="fp8_e4m3", kv_check_fraction=1.0,
              force_kv_dtype=True) as llm:
        llm.generate(PROMPTS * 2, SamplingParams(temperature=0.8, max_tokens=64, seed=1,
                                                 ignore_eos=True))
        s = llm.engine.runner.model_runner.kv_check.stats
        assert s.checks >= 60 and s.layer_checks >= 4 * 60
        assert s.alarms == 0, s
        assert not llm.engine.kv.promoted_layers()


def test_speculative_rollback_over_a_quantized_cache(model_dir, tmp_path, reference):
    """Prompt-lookup speculation writes draft rows into the quantized cache and rolls the
    rejected ones back (they are overwritten): the output stays the engine's own."""
    prompts = [p * 3 for p in PROMPTS]      # repetitive: drafts are proposed
    with _llm(model_dir, tmp_path, kv_dtype="int8") as llm:
        plain = llm.generate(prompts, SP)
    with _llm(model_dir, tmp_path, kv_dtype="int8", **{"speculative.method": "ngram",
                                                       "speculative.mode": "on"}) as llm:
        spec = llm.generate(prompts, SP)
        stats = llm.scheduler_stats().spec
        # (The random model does not follow its prompt, so drafts are rejected: every one
        # is a rollback of rows written into the quantized cache.)
        assert stats.num_draft_tokens > stats.num_accepted_tokens
        llm.check_integrity()
        assert llm.kv_stats().used == 0
    _same_or_near_tie(spec, plain)


def test_kv_tiers_store_and_restore_the_quantized_form(model_dir, tmp_path):
    """Evicted quantized blocks go to host memory as 1-byte values plus scales and come
    back into the pool as they left it."""
    prompts = [[5 + (i * 11 + k) % 150 for k in range(40)] for i in range(6)]
    opts = dict(kv_dtype="int8", num_blocks=24, max_num_seqs=2,
                **{"kv_tiers.enabled": True, "kv_tiers.host_bytes": 1 << 22})
    with _llm(model_dir, tmp_path, **opts) as llm:
        first = llm.generate(prompts, SP)
        again = llm.generate(prompts, SP)
        host = sum((o.outputs[0].timings.cached_tokens_by_tier or {}).get("host", 0)
                   for o in again)
        assert host >= 64
        layout = llm.engine.tiers.layout
        assert layout.dtype == "int8+hadamard" and layout.scale_bytes == 4 * 2 * 8 * 2 * 4
        _same_or_near_tie(again, first)
        llm.check_integrity()
