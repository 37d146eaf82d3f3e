"""A constraint that starts after the model's thinking (GuidedDecoding.gate): while the output
thinks every token is allowed and none reaches the grammar; the end tag starts it; where the
output may open its thinking itself, its first token may be the start tag beside what the
grammar allows. Replays (preemption) land in the same place; drafts are never verified while
thinking. Uses the tiny word-level tokenizer ("w3" ...), w250 / w251 standing for the
tags."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tokenloom.actors.execution.guided import GuidedCompiler, GuidedMatcher, allocate_bitmask
from tokenloom.actors.execution.model_runner import ModelRunner
from tokenloom.actors.messages import NewSequence
from tokenloom.actors.sampling_params import GuidedDecoding, ReasoningGate, SamplingParams

VOCAB, EOS, START, END = 256, 2, 250, 251
TWO_TEENS = "(w1[0-9]){2}"


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    from tinymodel import save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return GuidedCompiler(AutoTokenizer.from_pretrained(path), VOCAB, (EOS,))


def allowed(matcher: GuidedMatcher) -> list[int]:
    mask = allocate_bitmask(1, VOCAB)
    matcher.fill(mask, 0)
    return [t for t in range(VOCAB) if (int(mask[0, t // 32]) >> (t % 32)) & 1]


def matcher(compiler, gate: ReasoningGate | None) -> GuidedMatcher:
    return GuidedMatcher(compiler.compile(GuidedDecoding("regex", TWO_TEENS)), gate)


TEENS = list(range(10, 20))


def test_an_opened_thinking_is_free_until_its_end_tag(compiler):
    m = matcher(compiler, ReasoningGate(end_token_id=END, start_token_id=START, opened=True))
    assert allowed(m) == list(range(VOCAB))
    for t in (40, 99, START, EOS - 1, 12):
        assert m.accept(t) and not m.terminated
    assert allowed(m) == list(range(VOCAB))
    assert m.accept(END)
    assert allowed(m) == TEENS
    assert not m.accept(40)              # the grammar applies now
    assert m.accept(12) and m.accept(13) and allowed(m) == [EOS]
    assert m.accept(EOS) and m.terminated and m.num_accepted == 9


def test_the_first_token_may_open_the_thinking(compiler):
    gate = ReasoningGate(end_token_id=END, start_token_id=START)
    m = matcher(compiler, gate)
    assert allowed(m) == TEENS + [START]
    assert m.accept(START) and allowed(m) == list(range(VOCAB))
    assert m.accept(77) and m.accept(END) and allowed(m) == TEENS
    # ... or not: then the grammar applies from the first token, and the tag is refused.
    m = matcher(compiler, gate)
    assert m.accept(15) and allowed(m) == TEENS and not m.accept(START)


def test_without_a_gate_or_a_start_tag_the_grammar_applies_at_once(compiler):
    assert allowed(matcher(compiler, None)) == TEENS
    assert allowed(matcher(compiler, ReasoningGate(end_token_id=END))) == TEENS


def test_replay_lands_where_the_output_left_it(compiler):
    gate = ReasoningGate(end_token_id=END, start_token_id=START)
    m = matcher(compiler, gate)
    assert m.replay([START, 40, 41, END, 11]) and m.num_accepted == 5
    assert allowed(m) == TEENS and m.accept(12) and allowed(m) == [EOS]


def test_drafts_are_not_verified_while_thinking(compiler):
    m = matcher(compiler, ReasoningGate(end_token_id=END, opened=True))
    mask = allocate_bitmask(3, VOCAB)
    assert m.legal_prefix([40, END, 12]) == 0
    assert m.fill_drafts(mask, 0, [40, END]) == 0
    assert bool((mask[0] == -1).all())
    assert m.accept(END) and m.legal_prefix([12, 13, EOS]) == 2


def test_the_gate_travels_in_sampling_params_and_the_runner_uses_it(compiler):
    guided = GuidedDecoding("regex", TWO_TEENS, ReasoningGate(END, START, True))
    p = SamplingParams(temperature=0, guided=guided)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p
    runner = ModelRunner(None, None, torch.device("cpu"), (EOS,), guided=compiler)
    runner._register("r", NewSequence(prompt_token_ids=[5], output_token_ids=[40, 41],
                                      sampling_params=p))
    logits = torch.randn(1, VOCAB)
    assert torch.equal(runner.guided.apply(logits.clone(), ["r"]), logits)   # thinking
    runner._register("s", NewSequence(prompt_token_ids=[5], output_token_ids=[40, END],
                                      sampling_params=p))
    out = runner.guided.apply(torch.zeros(1, VOCAB), ["s"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == TEENS
