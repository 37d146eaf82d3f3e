"""Constrained (guided) requests that speculate, through the real engine on a tiny model.

Verification rows are masked by the grammar state after the drafts before them, drafts
the grammar refuses are cut, and the matcher only ever follows the verified output. So:
1. greedy constrained output with speculation on is token for token the output with it
   off, batched and under preemption by recompute and by swap (a preempted request
   resumes with its grammar state), with drafts both accepted and rejected;
2. sampled constrained output with speculation is well-formed and reproducible by seed
   (the distribution itself: tests/actors/execution/test_guided.py, chi-square).

A random model does not repeat itself, so an oracle proposer proposes the reference
continuation, corrupted at rotating positions, and every third proposal carries a word the
grammar refuses (cut before verification).
"""

from __future__ import annotations

import random
import re

import pytest

from tokenloom import LLM, GuidedDecoding, SamplingParams

from tinymodel import VOCAB, build_tiny_model

MAX_TOKENS = 24
BLOCK = 8
# Pairs of words w1x w2x, then EOS after at least 2 pairs (the model picks when): what a
# verification row allows depends on the drafts before it. ("w1" and "w2" are not words of
# the tiny tokenizer, so no word is a dead-end prefix of another.)
PATTERN = "(w1[0-9]w2[0-9]){2,15}"
WORDS = GuidedDecoding("regex", PATTERN)
REFUSED = 200   # "w200": the regex allows no third digit


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("guided-spec-model")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=11)
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (37, 9, 70, 16)]


class OracleProposer:
    """Proposes the reference continuation of each prompt; every second proposal is
    corrupted at a rotating position (rejections at every position), every third of those
    with a word the grammar refuses there (cut before verification)."""

    def __init__(self, refs: dict[tuple, list[int]]):
        self.refs = refs
        self.counts: dict[str, int] = {}   # per request: the same proposals whatever the
                                           # batches (seeded sampling stays reproducible)

    def propose(self, seqs, states):
        out = []
        for s, state in zip(seqs, states):
            ref = self.refs[tuple(state.row.prompt_token_ids)]
            tokens = list(ref[len(state.output_token_ids):][:s.propose])
            count = self.counts[s.request_id] = self.counts.get(s.request_id, 0) + 1
            if tokens and count % 2 == 0:
                j = (count // 2) % len(tokens)
                t = tokens[j]   # another word of the same kind (allowed), or a refused one
                tokens[j] = t // 10 * 10 + (t + 1) % 10 if count % 3 else REFUSED
            out.append((tokens, None))
        return out


def make_llm(path, tmp_path, **options) -> LLM:
    return LLM(model=str(path), quiet=True, device="cpu", dtype="float32",
               cache_dir=str(tmp_path), block_size=BLOCK,
               **{"speculative.method": "ngram", "speculative.num_speculative_tokens": 4,
                  **options})


def greedy(speculative: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, guided=WORDS,
                          speculative=speculative)


SCHEDULES = {
    "batched": dict(),
    "preempt": dict(num_blocks=14, max_num_seqs=4, admission_lookahead_tokens=0,
                    kv_watermark=0.0, kv_resume_watermark=0.0),
    "preempt-swap": dict(num_blocks=14, max_num_seqs=4, admission_lookahead_tokens=0,
                         kv_watermark=0.0, kv_resume_watermark=0.0, preemption_mode="swap",
                         swap_space_bytes=1 << 20),
}


@pytest.fixture(scope="module")
def refs(model_path, prompts, tmp_path_factory):
    """Greedy constrained output without speculation; the same whether the grammar masks
    are filled on the guided worker while the forward runs (the default on CUDA) or after
    it (on CPU)."""
    llm = make_llm(model_path, tmp_path_factory.mktemp("ref"))
    runner = llm.engine.runner.model_runner
    try:
        outs = llm.generate(prompts, greedy("off"))
        assert runner.guided.worker is None and not runner.guided.overlap
        runner.guided.overlap = True
        during = llm.generate(prompts, greedy("off"))
        assert runner.guided.worker is not None    # the masks were filled there
    finally:
        llm.close()
    assert [o.token_ids for o in during] == [o.token_ids for o in outs]
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


def _text_ok(text: str) -> bool:
    return re.fullmatch(PATTERN, text.replace(" ", "")) is not None


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_constrained_output_is_the_same_with_speculation(model_path, prompts, refs,
                                                                tmp_path, schedule):
    llm = make_llm(model_path, tmp_path, **SCHEDULES[schedule])
    proposer = OracleProposer(refs)
    llm.engine.runner.model_runner.proposer = proposer
    try:
        outs = llm.generate(prompts, greedy("on"))
        stats = llm.scheduler_stats()
        llm.check_integrity()
        assert llm.kv_stats().used == 0
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
    assert all(_text_ok(o.text) for o in outs), [o.text for o in outs]
    assert {o.finish_reason for o in outs} <= {"stop", "length"}
    spec = stats.spec
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0, spec
    assert all(a > 0 for a in spec.accepted_per_position), spec
    if schedule.startswith("preempt"):
        assert stats.num_preemptions > 0


def test_sampled_constrained_speculation_is_well_formed_and_seeded(model_path, prompts, refs,
                                                                   tmp_path):
    params = SamplingParams(temperature=1.2, seed=3, max_tokens=MAX_TOKENS, guided=WORDS,
                            speculative="on", n=2)
    runs = []
    for i in range(2):
        llm = make_llm(model_path, tmp_path / str(i))
        llm.engine.runner.model_runner.proposer = OracleProposer(refs)
        try:
            outs = llm.generate(prompts, params)
            runs.append([[c.token_ids for c in o.outputs] for o in outs])
            texts = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
            stats = llm.scheduler_stats()
        finally:
            llm.close()
        assert texts and all(_text_ok(t) for t in texts), texts
        assert stats.spec.num_accepted_tokens > 0, stats.spec
    assert runs[0] == runs[1]


def test_draft_model_proposals_are_cut_and_restricted_to_the_grammar(model_path, prompts,
                                                                      refs, tmp_path):
    """The target as its own draft model (unconstrained: it drafts words the grammar may
    refuse, cut; sampled requests draft from q, restricted to the grammar before
    verification): greedy output equals the reference, sampled output is well-formed (a
    grammar of any 4 to 8 words, so that most drafts are allowed and verified), and
    drafts are accepted."""
    llm = LLM(model=str(model_path), quiet=True, device="cpu", dtype="float32",
              cache_dir=str(tmp_path), block_size=BLOCK,
              **{"speculative.method": "draft", "speculative.draft_model": str(model_path),
                 "speculative.num_speculative_tokens": 3})
    try:
        got = [o.token_ids for o in llm.generate(prompts, greedy("on"))]
        sampled = llm.generate(prompts, SamplingParams(
            temperature=1.0, seed=4, guided=GuidedDecoding("regex", "(w[0-9]+){4,8}"),
            max_tokens=MAX_TOKENS, speculative="on"))
        spec = llm.scheduler_stats().spec
        llm.check_integrity()
    finally:
        llm.close()
    assert got == [refs[tuple(p)] for p in prompts]
    texts = [o.text.replace(" ", "") for o in sampled if o.finish_reason == "stop"]
    assert texts and all(re.fullmatch("(w[0-9]+){4,8}", t) for t in texts), texts
    assert spec.num_accepted_tokens > 0, spec
