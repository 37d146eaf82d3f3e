"""Verification of speculative proposals: greedy is exact token for token; sampled rows
keep the target distribution (chi-square over many seeds, like the sampler's tests)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.kernels.sampling import SamplingRow, make_generator, sample
from tokenloom.kernels.spec_verify import Proposal, expand_rows, verify

CHI2_LIMIT_15 = 37.7   # 0.999 quantile of chi-square with 15 degrees of freedom


def _row(params, seed=0, output=()):
    gen = None if params.is_greedy else make_generator(seed, "cpu")
    return SamplingRow(params, gen, [1, 2, 3], list(output), (0,))


def test_greedy_accepts_the_matching_prefix_then_corrects():
    logits = torch.full((4, 8), -5.0)
    for j, best in enumerate([3, 4, 5, 6]):
        logits[j, best] = 5.0
    row = _row(SamplingParams.greedy())
    assert [s.token_id for s in verify(logits, [Proposal(expand_rows(row, [3, 4, 5]),
                                                         [3, 4, 5])])[0]] == [3, 4, 5, 6]
    assert [s.token_id for s in verify(logits, [Proposal(expand_rows(row, [3, 7, 5]),
                                                         [3, 7, 5])])[0]] == [3, 4]
    assert [s.token_id for s in verify(logits, [Proposal(expand_rows(row, [1, 4, 5]),
                                                         [1, 4, 5])])[0]] == [3]


def test_greedy_rows_see_drafts_in_their_penalty_history():
    """Row j is penalised as if drafts 0..j-1 had been sampled: with a strong frequency
    penalty the repeated draft loses to the runner-up at row 1."""
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0], [0.0, 3.0, 2.5, 0.0]])
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    row = _row(params)
    got = verify(logits, [Proposal(expand_rows(row, [1]), [1])])[0]
    assert [s.token_id for s in got] == [1, 2]
    # The same as sampling each position with that history.
    ref = sample(logits[1:2], [expand_rows(row, [1])[1]])[0].token_id
    assert ref == 2


def test_logprobs_of_emitted_tokens_are_the_raw_rows():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]
    row = _row(SamplingParams(temperature=0, logprobs=2))
    got = verify(logits, [Proposal(expand_rows(row, drafts), drafts)])[0]
    assert len(got) == 3
    for j, s in enumerate(got):
        lp = logits[j].log_softmax(-1)
        assert s.logprob == pytest.approx(float(lp[s.token_id]), abs=1e-5)
        assert [t for t, _ in s.top_logprobs] == lp.topk(2).indices.tolist()


def _joint_counts(logits, drafts, draft_probs, params, draws):
    """The first two tokens of `draws` seeded runs: verification, then (if it emitted only
    one token) the next step's plain sample from row 1."""
    counts = Counter()
    drafter = torch.Generator().manual_seed(12345)
    for seed in range(draws):
        row = _row(params, seed)
        if draft_probs is not None:   # a draft model samples each draft from its q_j
            drafts = [int(torch.multinomial(q, 1, generator=drafter)) for q in draft_probs]
        prop = Proposal(expand_rows(row, drafts), drafts, draft_probs)
        tokens = [s.token_id for s in verify(logits, [prop])[0]]
        if len(tokens) < 2:
            nxt = expand_rows(row, tokens)[1]
            tokens.append(sample(logits[1:2], [nxt])[0].token_id)
        counts[tokens[0] * 4 + tokens[1]] += 1
    return counts


def _chi_square(counts, probs, draws):
    return sum((counts.get(i, 0) - draws * p) ** 2 / (draws * p)
               for i, p in enumerate(probs.tolist()) if p > 0)


@pytest.mark.parametrize("proposer", ["point-mass", "draft-model"])
def test_rejection_sampling_keeps_the_target_distribution(proposer):
    """Two-token joint distribution over a 4-token vocabulary: drawn with speculation
    (drafts from a point mass as prompt lookup proposes, or from a different draft
    distribution) it matches p0 x p1 of the target rows."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.4], [0.1, 1.2, -1.0, 0.3], [0.5, 0.5, 0.5, 0.5]])
    params = SamplingParams(temperature=1.0)
    draws = 2000
    if proposer == "point-mass":
        drafts, q = [0, 1], None
    else:
        q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.3, 0.1, 0.3, 0.3]])
        drafts = None   # drawn from q per run
    counts = _joint_counts(logits, drafts, q, params, draws)
    p = logits.softmax(-1)
    joint = (p[0][:, None] * p[1][None, :]).flatten()
    assert _chi_square(counts, joint, draws) < CHI2_LIMIT_15
    # Guard: the statistic does tell distributions apart at this many draws.
    wrong = (logits[:2] * 2).softmax(-1)
    assert _chi_square(counts, (wrong[0][:, None] * wrong[1][None, :]).flatten(),
                       draws) > 3 * CHI2_LIMIT_15


def test_filters_apply_to_the_target_rows():
    """top_k=1 makes every row a point mass: only the argmax path survives, whatever the
    drafts, and rejected drafts never leak through."""
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 3.0]])
    params = SamplingParams(temperature=1.0, top_k=1)
    for seed in range(20):
        row = _row(params, seed)
        got = verify(logits, [Proposal(expand_rows(row, [0, 2]), [0, 2])])[0]
        assert [s.token_id for s in got] == [0, 1]
