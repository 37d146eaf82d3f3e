"""Prefix caching on the real default model: identical greedy output with caching on and
off, exact `cached_tokens`, and isolation between cache salts."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.slow

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SHARED = ("You are a meticulous assistant. Answer using the policy document below.\n"
          + "Policy: refunds within 30 days; exchanges within 60 days; keep the receipt. " * 6)
QUESTIONS = ["Q: Can I return shoes after 45 days?\nA:", "Q: Do I need a receipt?\nA:",
             "Q: What about exchanges after 50 days?\nA:"]


def _llm(model_dir, **options) -> LLM:
    return LLM(model=str(model_dir), quiet=True, dtype="float32", device="cpu",
               block_size=BS, **options)


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    shared = tok.encode(SHARED)
    return shared, [shared + tok.encode(q) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts):
    """Greedy outputs with caching off, each prompt alone."""
    llm = _llm(default_model_dir, enable_prefix_caching=False)
    try:
        return [llm.generate([p], GREEDY)[0].token_ids for p in prompts[1]]
    finally:
        llm.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_hits_are_exact_and_output_is_unchanged(default_model_dir, prompts, reference, chunked):
    shared, full = prompts
    options = dict(max_num_batched_tokens=32, max_num_seqs=8) if chunked else {}
    llm = _llm(default_model_dir, **options)
    try:
        first = llm.generate([full[0]], GREEDY)[0]          # fills the cache
        assert first.token_ids == reference[0]
        assert first.outputs[0].timings.num_cached_tokens == 0
        assert first.outputs[0].timings.prefix_miss_reason == "no_prefix"
        rest = llm.generate(full[1:], GREEDY)              # share the prefix
        for out, ref in zip(rest, reference[1:]):
            assert out.token_ids == ref
            assert out.outputs[0].timings.num_cached_tokens == (len(shared) // BS) * BS
        again = llm.generate([full[0]], GREEDY)[0]           # the whole prompt was seen
        assert again.token_ids == reference[0]
        assert again.outputs[0].timings.num_cached_tokens == ((len(full[0]) - 1) // BS) * BS
        llm.wait_for_idle()
        llm.check_integrity()
    finally:
        llm.close()


def test_salts_isolate_and_same_salt_shares(default_model_dir, prompts, reference):
    _, full = prompts
    llm = _llm(default_model_dir)
    try:
        a = llm.generate([full[0]], GREEDY, cache_salt="tenant-a")[0]
        b = llm.generate([full[0]], GREEDY, cache_salt="tenant-b")[0]
        a2 = llm.generate([full[0]], GREEDY, cache_salt="tenant-a")[0]
        unsalted = llm.generate([full[0]], GREEDY)[0]
        assert a.token_ids == b.token_ids == a2.token_ids == unsalted.token_ids == reference[0]
        t = lambda o: o.outputs[0].timings  # noqa: E731
        assert t(a).num_cached_tokens == 0
        assert t(b).num_cached_tokens == 0 and t(b).prefix_miss_reason == "isolation"
        assert t(a2).num_cached_tokens == ((len(full[0]) - 1) // BS) * BS
        assert t(unsalted).num_cached_tokens == 0
        llm.wait_for_idle()
        llm.check_integrity()
    finally:
        llm.close()


def test_flush_events_and_eviction_reason(default_model_dir, prompts, reference):
    """1. events report every stored block; 2. flush refuses while a request runs;
    3. a forced/idle flush frees the cached blocks and emits AllBlocksCleared;
    4. the same prompt then misses with reason `evicted`."""
    import threading
    import time

    from tokenloom.actors.kv.events import AllBlocksCleared, BlockStored

    _, full = prompts
    llm = _llm(default_model_dir)
    events = []
    try:
        llm.subscribe_kv_events(events.append)
        out = llm.generate([full[0]], GREEDY)[0]
        assert out.token_ids == reference[0]
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        assert len(stored) == (len(full[0]) + len(out.token_ids) - 1) // BS

        long = threading.Thread(target=llm.generate, args=([full[1]], SamplingParams(
            temperature=0.0, max_tokens=200, ignore_eos=True)))
        long.start()
        deadline = time.monotonic() + 30
        while llm.scheduler_stats().running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = llm.flush_cache()
        assert refused.freed == 0 and refused.refused_reason
        long.join()

        llm.wait_for_idle()
        flushed = llm.flush_cache()
        assert flushed.freed > 0 and flushed.refused_reason is None
        assert isinstance(events[-1], AllBlocksCleared)
        assert llm.kv_stats().cached_blocks == 0
        again = llm.generate([full[0]], GREEDY)[0]
        assert again.token_ids == reference[0]
        assert again.outputs[0].timings.num_cached_tokens == 0
        assert again.outputs[0].timings.prefix_miss_reason == "evicted"
        llm.wait_for_idle()
        llm.check_integrity()
    finally:
        llm.close()


def test_n_siblings_share_the_prompt_blocks(default_model_dir, prompts, reference):
    """n=3 greedy: sibling 0 computes the prompt; siblings 1 and 2 are forked from it (its
    full blocks shared, its partial last block copied on write) and recompute one token."""
    _, full = prompts
    llm = _llm(default_model_dir)
    try:
        out = llm.generate([full[2]], SamplingParams(temperature=0.0, max_tokens=12, n=3))[0]
        assert [o.token_ids for o in out.outputs] == [reference[2]] * 3
        cached = [o.timings.num_cached_tokens for o in out.outputs]
        assert cached == [0] + [((len(full[2]) - 1) // BS) * BS] * 2
        assert llm.scheduler_stats().num_forks == 2
        llm.wait_for_idle()
        llm.check_integrity()
    finally:
        llm.close()
