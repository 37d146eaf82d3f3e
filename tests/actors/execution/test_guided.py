"""Guided decoding pieces without a model: the constraint in SamplingParams (validated,
msgpack-encodable), the compiler (errors name the field; a cache keyed by constraint), and the
runner's per-request grammar state (masks only constrained rows; kept across preemption,
rebuilt when the output it followed changed). Uses the tiny word-level tokenizer ("w3" ...)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tokenloom.actors.execution.guided import GuidedCompiler, GuidedError
from tokenloom.actors.execution.model_runner import ModelRunner
from tokenloom.actors.messages import NewSequence
from tokenloom.actors.sampling_params import GuidedDecoding, SamplingParams

VOCAB = 256
EOS = 2


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from transformers import AutoTokenizer

    from tinymodel import save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return GuidedCompiler(AutoTokenizer.from_pretrained(path), VOCAB, (EOS,))


def allowed(mask_row: torch.Tensor) -> list[int]:
    return [t for t in range(VOCAB) if (int(mask_row[t // 32]) >> (t % 32)) & 1]


# -- SamplingParams ------------------------------------------------------------------------
def test_guided_params_round_trip_through_msgpack():
    p = SamplingParams(guided=GuidedDecoding("choice", '["w5","w6"]'), n=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=SamplingParams) == p


@pytest.mark.parametrize("kwargs, field", [
    (dict(guided=GuidedDecoding("yaml", "x")), "guided.kind"),
    (dict(guided=GuidedDecoding("regex", "")), "guided.spec"),
    (dict(guided=GuidedDecoding("choice", '["a", ""]')), "guided.spec"),
    (dict(guided=GuidedDecoding("choice", "not json")), "guided.spec"),
    (dict(guided=GuidedDecoding("regex", "a"), ignore_eos=True), "ignore_eos"),
])
def test_bad_guided_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field), e.value


# -- compiler ------------------------------------------------------------------------------
@pytest.mark.parametrize("guided, param", [
    (GuidedDecoding("regex", "a[]"), "guided_regex"),
    (GuidedDecoding("regex", r"[^\s\S]"), "guided_regex"),
    (GuidedDecoding("grammar", "root ::= nothing"), "guided_grammar"),
    (GuidedDecoding("json_schema", '{"type": "bogus"}'), "response_format.json_schema"),
])
def test_compile_errors_name_the_field(compiler, guided, param):
    with pytest.raises(GuidedError) as e:
        compiler.compile(guided)
    assert e.value.param == param and str(e.value).startswith(param)
    assert "/project/cpp" not in str(e.value)   # the engine's source location is noise


def test_compiled_grammars_are_cached_by_constraint(compiler):
    a = compiler.compile(GuidedDecoding("regex", "(w1[0-9])+"))
    assert compiler.compile(GuidedDecoding("regex", "(w1[0-9])+")) is a
    assert compiler.compile(GuidedDecoding("regex", "(w2[0-9])+")) is not a


# -- runner state --------------------------------------------------------------------------
def _runner(compiler) -> ModelRunner:
    return ModelRunner(None, None, torch.device("cpu"), (EOS,), guided=compiler)


def _new(outputs, guided=GuidedDecoding("regex", "(w1[0-9]){3}")) -> NewSequence:
    return NewSequence(prompt_token_ids=[5, 6], output_token_ids=list(outputs),
                       sampling_params=SamplingParams(temperature=0, guided=guided))


def test_only_constrained_rows_are_masked(compiler):
    runner = _runner(compiler)
    runner._register("g", _new([10]))
    runner._register("plain", NewSequence(prompt_token_ids=[5], output_token_ids=[],
                                          sampling_params=SamplingParams(temperature=0)))
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    out = runner.guided.apply(logits, ["plain", "g"])
    assert torch.equal(out[0], before[0])                      # untouched, bit for bit
    finite = out[1].isfinite().nonzero()[:, 0].tolist()
    assert finite == list(range(10, 20))                       # the regex's next words only
    assert torch.equal(out[1, 10:20], before[1, 10:20])


def test_preempted_request_resumes_with_its_grammar_state(compiler):
    """1. registered with one output token 2. two more accepted 3. re-registered after a
    preemption with the same output: the very same matcher goes on, and after the third
    word it allows only EOS 4. re-registered with a different (shorter) output: the matcher
    is rebuilt from that output."""
    runner = _runner(compiler)
    runner._register("r", _new([10]))
    state = runner._seqs["r"]
    matcher = state.matcher
    assert matcher.num_accepted == 1 and matcher.accept(11)
    state.output_token_ids.append(11)
    runner._register("r", _new([10, 11]))
    assert runner._seqs["r"].matcher is matcher
    out = runner.guided.apply(torch.zeros(1, VOCAB), ["r"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == list(range(10, 20))
    assert matcher.accept(12)
    state.output_token_ids.append(12)
    runner._register("r", _new([10, 11, 12]))
    out = runner.guided.apply(torch.zeros(1, VOCAB), ["r"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == [EOS]
    runner._register("r", _new([13]))
    rebuilt = runner._seqs["r"].matcher
    assert rebuilt is not matcher and rebuilt.num_accepted == 1


def test_forked_sibling_replays_its_output(compiler):
    """A sequence registered with output already produced (an n>1 sibling) starts from it."""
    runner = _runner(compiler)
    runner._register("s1", _new([14, 15]))
    out = runner.guided.apply(torch.zeros(1, VOCAB), ["s1"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == list(range(10, 20))
    runner._register("s2", _new([14, 15, 16]))
    out = runner.guided.apply(torch.zeros(1, VOCAB), ["s2"])
    assert out[0].isfinite().nonzero()[:, 0].tolist() == [EOS]


# -- speculative verification --------------------------------------------------------------
# After w4: w5 or w6; after w5: w6 or w7; after w6: w4; then EOS.
PAIRS = GuidedDecoding("grammar", 'root ::= "w4" ("w5" | "w6") | "w5" ("w6" | "w7") | "w6" "w4"')


def _matcher(compiler, guided=PAIRS):
    from tokenloom.actors.execution.guided import GuidedMatcher
    return GuidedMatcher(compiler.compile(guided))


def test_draft_masks_follow_the_drafts_and_leave_the_matcher_alone(compiler):
    """Row j is the mask after drafts 0..j-1; a refused draft cuts the proposal; a draft
    that ends the grammar (EOS) is left to the sampler; the matcher is not moved."""
    from tokenloom.actors.execution.guided import allocate_bitmask
    m = _matcher(compiler)
    mask = allocate_bitmask(4, VOCAB)
    assert m.fill_drafts(mask, 0, [4, 5, EOS]) == 2
    assert [allowed(mask[j]) for j in range(3)] == [[4, 5, 6], [5, 6], [EOS]]
    assert m.fill_drafts(mask, 1, [4, 7, 6]) == 1          # w7 cannot follow w4
    assert [allowed(mask[j]) for j in (1, 2)] == [[4, 5, 6], [5, 6]]
    assert m.fill_drafts(mask, 0, [9]) == 0
    assert m.num_accepted == 0 and m.legal_prefix([6, 4, EOS, 5]) == 2
    assert m.accept(5) and m.legal_prefix([7, EOS]) == 1 and m.legal_prefix([4]) == 0
    assert m.num_accepted == 1 and m.accept(7) and m.accept(EOS) and m.terminated
    assert m.fill_drafts(mask, 0, [EOS]) is None and m.legal_prefix([EOS]) == 0


def test_runner_masks_verification_rows_and_cuts_refused_drafts(compiler):
    """A guided request verifying drafts [w4, w7, w6] (w7 is refused after w4) in a step
    with a plain request: its rows 0 and 1 are masked by state, the proposal is cut to
    [w4], the plain row is untouched."""
    runner = _runner(compiler)
    runner._register("g", _new([], PAIRS))
    runner._register("plain", NewSequence(prompt_token_ids=[5], output_token_ids=[],
                                          sampling_params=SamplingParams(temperature=0)))
    logits = torch.randn(5, VOCAB)
    before = logits.clone()
    drafts = {"g": [4, 7, 6]}
    out = runner.guided.apply(logits, ["plain", "g", "g", "g", "g"], drafts)
    assert drafts == {"g": [4]}
    assert torch.equal(out[0], before[0])
    assert out[1].isfinite().nonzero()[:, 0].tolist() == [4, 5, 6]
    assert out[2].isfinite().nonzero()[:, 0].tolist() == [5, 6]
    assert runner._seqs["g"].matcher.num_accepted == 0


def _pair_counts(compiler, logits, params, draws, proposer):
    """First two tokens of `draws` seeded runs of a guided request that speculates two
    drafts (masks by state, a refused draft cut, a draft model's q restricted to the
    grammar as the runner does it), then, if verification emitted one token,
    the next step's plain masked sample from row 1."""
    from collections import Counter

    from tokenloom.actors.execution.guided import (
        allocate_bitmask,
        apply_bitmask,
        restrict_draft_probs,
    )
    from tokenloom.kernels.sampling import SamplingRow, make_generator, sample
    from tokenloom.kernels.spec_verify import Proposal, expand_rows, verify
    counts, drafter = Counter(), torch.Generator().manual_seed(1)
    q = torch.zeros(2, VOCAB)
    q[0, [4, 5, 9]] = torch.tensor([0.5, 0.3, 0.2])   # w9 is never allowed: cut at 0
    q[1, [5, 6, 7]] = torch.tensor([0.3, 0.3, 0.4])   # w7 is refused after w4
    for seed in range(draws):
        m = _matcher(compiler)
        row = SamplingRow(params, make_generator(seed, "cpu"), [1, 3], [], (EOS,))
        if proposer == "point-mass":
            drafts, probs = [4, 7], None
        else:
            drafts, probs = [int(torch.multinomial(q[j], 1, generator=drafter))
                             for j in range(2)], q
        mask = allocate_bitmask(3, VOCAB)
        kept = m.fill_drafts(mask, 0, drafts)
        rows = logits.clone()
        apply_bitmask(rows, mask, list(range(kept + 1)))
        if probs is not None and kept:   # as the runner does
            probs = restrict_draft_probs(probs, mask, 0, kept)
        prop = Proposal(expand_rows(row, drafts[:kept]), drafts[:kept],
                        None if probs is None else probs[:kept])
        tokens = [s.token_id for s in verify(rows[:kept + 1], [prop])[0]]
        if len(tokens) < 2:
            assert m.accept(tokens[0])
            m.fill(mask, 1)
            nxt = logits[1:2].clone()
            apply_bitmask(nxt, mask[1:2], [0])
            tokens.append(sample(nxt, [expand_rows(row, tokens)[1]])[0].token_id)
        counts[tuple(tokens[:2])] += 1
    return counts


def _masked_pairs(logits):
    """The exact distribution of the first two tokens of PAIRS under these target rows."""
    follow = {4: [5, 6], 5: [6, 7], 6: [4]}
    p0 = logits[0, [4, 5, 6]].softmax(-1)
    out = {}
    for a, pa in zip([4, 5, 6], p0.tolist()):
        p1 = logits[1, follow[a]].softmax(-1)
        for b, pb in zip(follow[a], p1.tolist()):
            out[(a, b)] = pa * pb
    return out


@pytest.mark.parametrize("proposer", ["point-mass", "draft-model"])
def test_guided_speculation_keeps_the_constrained_distribution(compiler, proposer):
    """Sampled at temperature 1 with drafts verified on masked rows (drafts the grammar
    refuses cut): the first two tokens follow the grammar-masked target distribution,
    whose second token depends on the first (chi-square, 4 degrees of freedom)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, VOCAB, generator=g)
    logits[:, 4:8] = torch.tensor([[0.8, 0.2, -0.3, 1.5], [0.1, 1.0, -0.6, 0.9],
                                   [0.0, 0.0, 0.0, 0.0]])
    draws = 1200
    counts = _pair_counts(compiler, logits, SamplingParams(temperature=1.0), draws, proposer)
    assert set(counts) <= set(_masked_pairs(logits))

    def chi2(probs):
        return sum((counts.get(k, 0) - draws * p) ** 2 / (draws * p) for k, p in probs.items())

    assert chi2(_masked_pairs(logits)) < 18.47      # 0.999 quantile, 4 degrees of freedom
    # Guard: the statistic tells a wrong distribution apart at this many draws.
    assert chi2(_masked_pairs(logits * 2)) > 3 * 18.47
