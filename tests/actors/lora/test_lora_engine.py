"""Multi-LoRA serving through the engine, against transformers + PEFT greedy output.

A tiny random Llama and three random PEFT adapters (different ranks, targets, rsLoRA):
1. every schedule (all at once, chunked prefill, preemption) with base and adapter requests
   mixed in one batch gives each request its own adapter's greedy tokens;
2. with one device slot for three adapters, requests wait for the slot (never block the
   base model), adapters are evicted and loaded again from host memory, output unchanged;
3. prefix caching: the same prompt under the same adapter hits; under another adapter (or
   the base model) it never shares KV, and the KV events say which adapter stored a block;
4. adapters loaded and unloaded at run time; bad ones fail with a named error;
5. compiled CPU decode programs (static path) keep the same output and replay programs.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.kernels.lora.peft_adapter import LoRAAdapterError

from tinymodel import VOCAB, build_random_adapter, build_tiny_model, peft_oracle

MAX_TOKENS = 12
BS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    base = root / "base"
    build_tiny_model(base, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=21)
    adapters = {
        "a": build_random_adapter(base, root / "a", rank=8, seed=1),
        "b": build_random_adapter(base, root / "b", rank=4, seed=2, use_rslora=True,
                                  targets=("q_proj", "v_proj", "gate_proj", "down_proj")),
        "c": build_random_adapter(base, root / "c", rank=2, seed=3, targets=("o_proj",
                                                                             "up_proj")),
    }
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (37, 9, 21, 50, 14, 30)]
    names = ["a", None, "b", "c", "a", "b"]
    expected = []
    for p, name in zip(prompts, names):
        hf = peft_oracle(base, adapters[name] if name else None)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS,
                              eos_token_id=None, pad_token_id=0,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
        expected.append(out[0, len(p):].tolist())
    return base, adapters, prompts, names, expected


def make_llm(world, tmp_path, **options) -> LLM:
    base, adapters, *_ = world
    return LLM(model=str(base), quiet=True, dtype="float32", device="cpu",
               cache_dir=str(tmp_path), block_size=BS,
               **{"lora.modules": {k: str(v) for k, v in adapters.items()}}, **options)


SCHEDULES = {
    "all-at-once": dict(),
    "chunked": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "one-slot": {"lora.max_loras": 1, "lora.max_cpu_loras": 1},
    "preempt": dict(num_blocks=10, max_num_seqs=6, admission_lookahead_tokens=0,
                    kv_watermark=0.0, kv_resume_watermark=0.0),
    # Prompt-lookup speculation: drafts are verified by the target with each row's adapter.
    "ngram": {"speculative.method": "ngram", "speculative.mode": "on",
              "speculative.ngram_min": 1},
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_per_adapter_matches_peft(world, tmp_path, schedule):
    _, _, prompts, names, expected = world
    assert len({tuple(e) for e in expected}) == len(expected), "adapters must differ"
    llm = make_llm(world, tmp_path, **SCHEDULES[schedule])
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, lora=names)]
        stats = llm.scheduler_stats()
        llm.check_integrity()
    finally:
        llm.close()
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{schedule}: prompt {i} (adapter {names[i]}) diverges from PEFT"
    lora = stats.lora
    assert lora is not None and lora.registered == ["a", "b", "c"]
    assert lora.requests_by_adapter == {"a": 2, "b": 2, "c": 1}
    if schedule == "one-slot":
        assert lora.num_slot_waits > 0, "one slot for three adapters must make requests wait"
        assert lora.num_evictions >= 2 and lora.num_loads >= 3
    if schedule == "preempt":
        assert stats.num_preemptions > 0
    if schedule == "ngram":
        assert stats.spec.num_draft_tokens > 0, "no draft was verified"


def test_prefix_cache_is_per_adapter(world, tmp_path):
    _, _, prompts, _, _ = world
    p = prompts[3]   # 50 tokens: 6 full blocks
    events = []
    llm = make_llm(world, tmp_path)
    llm.subscribe_kv_events(events.append)
    try:
        first = llm.generate([p], GREEDY, lora="a")[0]
        same = llm.generate([p], GREEDY, lora="a")[0]
        other = llm.generate([p], GREEDY, lora="b")[0]
        base = llm.generate([p], GREEDY)[0]
        llm.check_integrity()
    finally:
        llm.close()
    def cached(out):
        return out.outputs[0].timings.num_cached_tokens

    assert cached(first) == 0
    assert cached(same) == 48 and same.token_ids == first.token_ids
    assert cached(other) == 0 and cached(base) == 0
    stored = [e for batch in events for e in getattr(batch, "events", [batch])
              if type(e).__name__ == "BlockStored"]
    assert {e.lora_name for e in stored} >= {"a", "b", None}


def test_runtime_load_unload_and_errors(world, tmp_path):
    base, adapters, prompts, names, expected = world
    llm = LLM(model=str(base), quiet=True, dtype="float32", device="cpu",
              cache_dir=str(tmp_path), block_size=BS, **{"lora.enable": True,
                                                        "lora.max_lora_rank": 4})
    try:
        with pytest.raises(ValueError, match="'b' is not loaded"):
            llm.generate([prompts[2]], GREEDY, lora="b")
        with pytest.raises(LoRAAdapterError, match="'a'.*rank 8.*max_lora_rank = 4"):
            llm.load_lora_adapter("a", str(adapters["a"]))
        llm.load_lora_adapter("b", str(adapters["b"]))
        assert llm.generate([prompts[2]], GREEDY, lora="b")[0].token_ids == expected[2]
        assert llm.generate([prompts[1]], GREEDY)[0].token_ids == expected[1]
        assert llm.unload_lora_adapter("b") is True
        assert llm.unload_lora_adapter("b") is False
        with pytest.raises(ValueError, match="'b' is not loaded"):
            llm.generate([prompts[2]], GREEDY, lora="b")
        llm.check_integrity()
    finally:
        llm.close()


@pytest.mark.slow
def test_compiled_programs_serve_adapters(world, tmp_path):
    """Decode steps replay compiled programs with the static LoRA path (every resident slot,
    masked per row); output equals PEFT's."""
    _, _, prompts, names, expected = world
    llm = make_llm(world, tmp_path, cpu_compile=True, cpu_capture_sizes=[4, 8])
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY, lora=names)]
        graphs = llm.graph_stats()
    finally:
        llm.close()
    assert got == expected
    assert graphs.replays > 0, "decode steps were meant to run compiled programs"


def test_siblings_of_an_adapter_request(world, tmp_path):
    """n > 1: sibling 0 computes the prompt, the others fork its blocks (no admission of
    their own) and must still decode with the adapter."""
    _, _, prompts, names, expected = world
    llm = make_llm(world, tmp_path)
    try:
        out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True, n=3), lora=names[0])[0]
        forks = llm.scheduler_stats().num_forks
        llm.check_integrity()
    finally:
        llm.close()
    assert forks > 0, "the siblings were meant to fork sibling 0's prompt blocks"
    assert [c.token_ids for c in out.outputs] == [expected[0]] * 3
