"""Speculative decoding through the real engine on a tiny random model.

Random models do not repeat their prompts, so prompt lookup alone would rarely be
accepted here. These tests use an oracle proposer instead — it knows transformers' greedy
continuation and proposes it, corrupted at fixed positions — so that every path runs:
all drafts accepted, a rejection at each position, the bonus token, rollback of rejected
KV slots. Then:
1. greedy output is token for token transformers' output under every schedule (batched,
   chunked prefill, preemption by recompute and by swap, prefix-cache hits, n > 1);
2. the pool's integrity check holds after every KV update (so after every step's rollback
   and growth) and no block is left used at the end;
3. the kill switch: with always-wrong proposals `auto` stops speculating (and the
   rejected work shows as such), with right ones it speculates; `off` never does;
4. decode streams that do not speculate are never skipped.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tinymodel import VOCAB, build_tiny_model, hf_greedy

MAX_TOKENS = 20
BLOCK = 8


@pytest.fixture(autouse=True)
def integrity_after_every_update(monkeypatch):
    """The KV manager checks its pool (free + cached + used == total, no block owned
    twice, tables consistent) after applying every update; a failure fails the step."""
    from tokenloom.actors.kv.kv_actor import KVManagerActor
    apply = KVManagerActor.apply
    checked = []

    def checked_apply(self, update):
        grant = apply(self, update)
        try:
            self.manager.check_integrity()
            checked.append(None)
        except AssertionError as e:   # recorded, not raised: the actor must keep serving
            checked.append(str(e))
        return grant

    monkeypatch.setattr(KVManagerActor, "apply", checked_apply)
    yield checked
    assert [p for p in checked if p is not None] == [], "pool integrity broken mid-run"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model dir, prompts, transformers' greedy continuations)."""
    from transformers import AutoModelForCausalLM
    path = tmp_path_factory.mktemp("spec-model")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=11)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (37, 9, 70, 16)]
    return path, prompts, [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


class OracleProposer:
    """Proposes the reference continuation; every `corrupt_every`-th proposal has its
    token at position (proposal count % k) replaced, so rejections hit every position."""

    def __init__(self, prompts, refs, corrupt_every: int = 3, wrong: bool = False):
        self.refs = {tuple(p): r for p, r in zip(prompts, refs)}
        self.corrupt_every = corrupt_every
        self.wrong = wrong
        self.count = 0

    def propose(self, seqs, states):
        out = []
        for s, state in zip(seqs, states):
            ref = self.refs[tuple(state.row.prompt_token_ids)]
            done = len(state.output_token_ids)
            tokens = list(ref[done:done + s.propose])
            self.count += 1
            if self.wrong:
                tokens = [(t + 1) % VOCAB for t in tokens]
            elif tokens and self.count % self.corrupt_every == 0:
                j = (self.count // self.corrupt_every) % len(tokens)
                tokens[j] = (tokens[j] + 1) % VOCAB
            out.append((tokens, None))
        return out


def make_llm(path, tmp_path, proposer=None, **options) -> LLM:
    llm = LLM(model=str(path), quiet=True, device="cpu", dtype="float32",
              cache_dir=str(tmp_path), block_size=BLOCK,
              **{"speculative.method": "ngram", "speculative.num_speculative_tokens": 4,
                 **options})
    if proposer is not None:
        llm.engine.runner.model_runner.proposer = proposer
    return llm


GREEDY_ON = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                           speculative="on")

SCHEDULES = {
    "batched": dict(),
    "chunked": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "preempt": dict(num_blocks=14, max_num_seqs=4, admission_lookahead_tokens=0,
                    kv_watermark=0.0, kv_resume_watermark=0.0),
    "preempt-swap": dict(num_blocks=14, max_num_seqs=4, admission_lookahead_tokens=0,
                         kv_watermark=0.0, kv_resume_watermark=0.0, preemption_mode="swap",
                         swap_space_bytes=1 << 20),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_output_is_exact_under_every_schedule(model, tmp_path, schedule,
                                                     integrity_after_every_update):
    path, prompts, refs = model
    llm = make_llm(path, tmp_path, OracleProposer(prompts, refs), **SCHEDULES[schedule])
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY_ON)]
        stats = llm.scheduler_stats()
        llm.check_integrity()
        assert llm.kv_stats().used == 0
    finally:
        llm.close()
    assert got == refs
    spec = stats.spec
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0, spec
    # Speculation saved steps: fewer steps than tokens per request would take one by one.
    assert stats.num_steps < MAX_TOKENS + len(prompts) * 2, stats.num_steps
    assert all(a > 0 for a in spec.accepted_per_position), spec
    if schedule.startswith("preempt"):
        assert stats.num_preemptions > 0
    assert stats.max_decode_skip == 0
    assert len(integrity_after_every_update) >= stats.num_steps


def test_prefix_hits_and_siblings(model, tmp_path):
    """The same prompts twice (the second time from the prefix cache, blocks committed
    after verified drafts), and n=2 siblings: all exact."""
    path, prompts, refs = model
    llm = make_llm(path, tmp_path, OracleProposer(prompts, refs, corrupt_every=2))
    try:
        first = [o.token_ids for o in llm.generate(prompts, GREEDY_ON)]
        second = llm.generate(prompts, GREEDY_ON)
        assert any(o.outputs[0].timings.num_cached_tokens > 0 for o in second)
        n2 = llm.generate(prompts[:2], SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS,
                                                      ignore_eos=True, speculative="on"))
        llm.check_integrity()
        assert llm.kv_stats().used == 0
    finally:
        llm.close()
    assert first == refs
    assert [o.token_ids for o in second] == refs
    for out, ref in zip(n2, refs):
        assert [c.token_ids for c in out.outputs] == [ref, ref]


def test_seeded_sampling_runs_and_is_reproducible(model, tmp_path):
    """Temperature > 0 through verification: valid tokens, the same for the same seed and
    the same schedule (the distribution itself is tested in tests/kernels)."""
    path, prompts, refs = model
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS,
                            ignore_eos=True, speculative="on", logprobs=1)
    outs = []
    for _ in range(2):
        llm = make_llm(path, tmp_path, OracleProposer(prompts, refs))
        try:
            outs.append(llm.generate(prompts[:1], params)[0])
            stats = llm.scheduler_stats()
            llm.check_integrity()
        finally:
            llm.close()
        assert stats.spec.num_drafts > 0
    a, b = outs
    assert a.token_ids == b.token_ids and len(a.token_ids) == MAX_TOKENS
    assert len(a.outputs[0].logprobs) == MAX_TOKENS


def test_kill_switch_stops_wrong_proposals_in_auto(model, tmp_path):
    """Always-wrong proposals: `auto` stops verifying them once the cost model knows the
    step cost (only probes and the first estimates get through), where "on" verifies
    them every step; the trace says why. Greedy output is exact throughout. (Which way
    `auto` decides for right proposals depends on measured step times: see
    test_spec_decode.py for the decision itself on a known cost model.)"""
    path, prompts, refs = model
    drafted = {}
    for mode in ("auto", "on"):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                speculative=mode)
        llm = make_llm(path, tmp_path, OracleProposer(prompts, refs, wrong=True),
                       **{"speculative.reprobe_steps": 8})
        try:
            llm.generate(prompts, params)   # fits the cost model (after 16 steps)
            before = llm.scheduler_stats().spec
            outs = llm.generate(prompts, params)
            after = llm.scheduler_stats().spec
            trace = llm.trace(outs[0].request_id)
        finally:
            llm.close()
        assert [o.token_ids for o in outs] == refs
        assert after.num_accepted_tokens == 0
        drafted[mode] = after.num_draft_tokens - before.num_draft_tokens
        if mode == "auto":
            decisions = trace[0]["speculation"]["decisions"]
            assert decisions.get("does_not_pay", 0) + decisions.get(
                "batch_does_not_pay", 0) > 0, decisions
    assert drafted["auto"] * 4 <= drafted["on"], drafted


def test_off_and_mixed_requests(model, tmp_path):
    """A request with speculative "off" never proposes; sharing the batch with speculating
    ones it is never skipped, and both are exact."""
    path, prompts, refs = model
    llm = make_llm(path, tmp_path, OracleProposer(prompts, refs))
    try:
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 speculative="off" if i % 2 else "on")
                  for i in range(len(prompts))]
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.scheduler_stats()
        traces = {i: llm.trace(o.request_id) for i, o in
                  enumerate(llm.generate(prompts[:2], params[:2]))}
    finally:
        llm.close()
    assert got == refs
    assert stats.max_decode_skip == 0
    assert traces[1][0].get("speculation") is None
    assert traces[0][0]["speculation"]["drafted"] > 0


def test_bad_speculative_field_is_rejected():
    with pytest.raises(ValueError, match="speculative must be one of auto, on, off"):
        SamplingParams(speculative="sometimes")


# -- draft model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A different random model with the same vocabulary: a poor but valid draft."""
    path = tmp_path_factory.mktemp("draft-model")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=1, tie_word_embeddings=True),
                     seed=99)
    return path


def draft_llm(path, tmp_path, draft, **options) -> LLM:
    return LLM(model=str(path), quiet=True, device="cpu", dtype="float32",
               cache_dir=str(tmp_path), block_size=BLOCK,
               **{"speculative.method": "draft", "speculative.draft_model": str(draft),
                  "speculative.num_speculative_tokens": 3, **options})


@pytest.mark.parametrize("schedule", ["batched", "chunked", "preempt", "preempt-swap"])
def test_draft_model_is_exact_and_a_copy_of_the_target_is_accepted(model, tmp_path, schedule):
    """The target as its own draft: its proposals are the target's own greedy tokens, so
    nearly all are accepted (the draft's KV, mirrored from every forward, is right —
    including after preemption, recomputed or swapped out and back in with the target's);
    output exact."""
    path, prompts, refs = model
    llm = draft_llm(path, tmp_path, path, **SCHEDULES[schedule])
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY_ON)]
        stats = llm.scheduler_stats()
        spec = stats.spec
        llm.check_integrity()
        assert llm.kv_stats().used == 0
    finally:
        llm.close()
    assert got == refs
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens, spec
    if schedule == "preempt-swap":
        assert stats.num_swap_preemptions > 0, stats


def test_a_different_draft_model_keeps_output_exact(model, tmp_path, other_draft):
    path, prompts, refs = model
    llm = draft_llm(path, tmp_path, other_draft, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY_ON)]
        sampled = llm.generate(prompts[:2], SamplingParams(
            temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True, speculative="on"))
        spec = llm.scheduler_stats().spec
        llm.check_integrity()
    finally:
        llm.close()
    assert got == refs
    assert spec.num_draft_tokens > spec.num_accepted_tokens
    assert all(len(o.token_ids) == MAX_TOKENS for o in sampled)


def test_draft_model_with_another_vocabulary_is_refused(model, tmp_path):
    from tokenloom.config.schema import ConfigError
    path, _, _ = model
    other = tmp_path / "big-vocab"
    build_tiny_model(other, "LlamaConfig", dict(num_hidden_layers=1, vocab_size=300), seed=1)
    with pytest.raises(ConfigError, match="speculative.draft_model .* vocabulary of 300"):
        draft_llm(path, tmp_path, other)
