"""A bf16 / fp16 KV cache under a float32 model (cache.kv_dtype) in a running engine (tiny
model): twice the blocks from the same budget, the start-up quality gate, serving through
chunked prefills, prefix hits, swap and the host tier with the same tokens whatever the
schedule, the C++ decode stack serving its steps, and the combinations it refuses."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.config.schema import CacheConfig, ConfigError

from tinymodel import build_tiny_model

PROMPTS = [[5 + (i * 13 + k) % 200 for k in range(30 + 7 * i)] for i in range(4)]
SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kvhalf")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=4), seed=3)
    return path


def _llm(model_dir, tmp_path, **options) -> LLM:
    options.setdefault("dtype", "float32")
    return LLM(model=str(model_dir), quiet=True, device="cpu",
               cache_dir=str(tmp_path / "cache"), block_size=8, **options)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_twice_the_blocks_and_the_same_tokens_whatever_the_schedule(model_dir, tmp_path,
                                                                    mode):
    budget = {"kv_cache_memory_bytes": 4 << 20}
    with _llm(model_dir, tmp_path, **budget) as llm:
        plain = llm.engine.info.num_blocks
    with _llm(model_dir, tmp_path, kv_dtype=mode, **budget) as llm:
        assert llm.engine.info.num_blocks == 2 * plain
        assert llm.engine.info.kv_bytes_per_token == 4 * 2 * 2 * 16 * 2
        assert llm.engine.kv.pool.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[mode]
        whole = llm.generate(PROMPTS, SP)          # one prefill per prompt
        model = llm.engine.runner.model_runner.model
        if model.decode_stacks is not None:        # the C++ stack reads the 2-byte pool
            assert model.decode_stacks.steps > 0
    # Chunked prefills (8 tokens a step), prefix hits, swap preemption: a row's stored
    # values depend only on the row, so the tokens are the same as above, exactly.
    with _llm(model_dir, tmp_path, kv_dtype=mode, num_blocks=24, max_num_seqs=4,
              max_num_batched_tokens=32, chunking="static", preemption_mode="swap",
              admission_lookahead_tokens=0, kv_watermark=0.0,
              kv_resume_watermark=0.0) as llm:
        chunked = llm.generate(PROMPTS, SP)
        again = llm.generate(PROMPTS, SP)
        assert sum(o.outputs[0].timings.num_cached_tokens for o in again) > 0
        assert llm.scheduler_stats().num_swap_preemptions > 0
        llm.check_integrity()
        assert llm.kv_stats().used == 0
    assert _tokens(chunked) == _tokens(whole) == _tokens(again)


def test_the_two_byte_cache_passes_its_start_up_gate(model_dir, tmp_path):
    from tokenloom.kernels.models.kv_quality_gate import apply_kv_gate

    with _llm(model_dir, tmp_path, kv_dtype="bf16") as llm:
        model = llm.engine.runner.model_runner.model
        args = (model, llm.engine.config.cache, llm.engine.tokenizer, "tiny", torch.float32,
                None)
        result = apply_kv_gate(*args)
        assert apply_kv_gate(model, CacheConfig(), *args[2:]) is None    # "auto": no gate
    assert result.passed and result.mode == "bf16", result.summary()
    assert 0 <= result.mean_kl < 0.01 and abs(result.ppl_increase) < 0.01


def test_the_host_tier_keeps_the_two_byte_form(model_dir, tmp_path):
    prompts = [[5 + (i * 11 + k) % 150 for k in range(40)] for i in range(6)]
    opts = dict(kv_dtype="fp16", num_blocks=24, max_num_seqs=2,
                **{"kv_tiers.enabled": True, "kv_tiers.host_bytes": 1 << 22})
    with _llm(model_dir, tmp_path, **opts) as llm:
        first = llm.generate(prompts, SP)
        again = llm.generate(prompts, SP)
        host = sum((o.outputs[0].timings.cached_tokens_by_tier or {}).get("host", 0)
                   for o in again)
        assert host >= 64
        layout = llm.engine.tiers.layout
        assert layout.dtype == "fp16" and layout.itemsize == 2 and layout.scale_bytes == 0
        llm.check_integrity()
    assert _tokens(again) == _tokens(first)


def test_refused_combinations_name_the_field(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="cache.kv_dtype 'fp16' under a bfloat16 model"):
        _llm(model_dir, tmp_path, kv_dtype="fp16", dtype="bfloat16")
    with _llm(model_dir, tmp_path, kv_dtype="bf16", dtype="bfloat16") as llm:   # = "auto"
        assert llm.engine.kv.pool.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="cache.k_dtype overrides a 1-byte") as info:
        CacheConfig(kv_dtype="bf16", k_dtype="int8")
    assert info.value.key == "cache.k_dtype"
    with pytest.raises(ConfigError, match="kv_rotation 'hadamard' applies to a quantized"):
        CacheConfig(kv_dtype="fp16", kv_rotation="hadamard")
    assert not CacheConfig(kv_dtype="bf16").kv_quantized
    assert CacheConfig(kv_dtype="int8").kv_quantized
