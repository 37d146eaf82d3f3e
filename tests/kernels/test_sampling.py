"""Batched sampler: each stage against a plain reference, seeded determinism, distribution."""

from collections import Counter

import pytest
import torch

from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.kernels.sampling import (
    Sample,
    SamplingRow,
    filter_logits,
    make_generator,
    process_logits,
    sample,
)

VOCAB = 64
# Probabilities 0.5, 0.3, 0.15, 0.05 over a 4-token vocab.
FOUR = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def make_row(params, seed=0, prompt=(), output=(), eos=()):
    generator = None if params.is_greedy else make_generator(seed, "cpu")
    return SamplingRow(params, generator, list(prompt), list(output), tuple(eos))


def random_logits(rows, vocab=VOCAB, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw_counts(logits_row, params, draws=4000):
    """Sample `draws` rows of the same logits, row i seeded with i; returns token counts."""
    logits = logits_row.expand(draws, -1).clone()
    rows = [make_row(params, seed=i) for i in range(draws)]
    return Counter(t.token_id for t in sample(logits, rows))


def chi_square(counts, probs):
    """Pearson statistic over tokens with nonzero expected probability."""
    draws = sum(counts.values())
    assert all(probs[t] > 0 for t in counts), f"drew a token with probability 0: {counts}"
    return sum(
        (counts.get(t, 0) - draws * p) ** 2 / (draws * p) for t, p in enumerate(probs.tolist()) if p
    )


# df <= 4 here: 0.999 quantiles are 10.8 (df 1) .. 18.5 (df 4). Seeds are fixed, so no flakes;
# a wrong distribution at 4000 draws scores in the hundreds.
CHI2_LIMIT = 18.5


def reference_penalties(logits, prompt, output, rep, presence, frequency):
    """Hugging Face repetition penalty, then OpenAI presence/frequency, one token at a time."""
    out = logits.tolist()
    seen, counts = set(prompt) | set(output), Counter(output)
    for t in range(len(out)):
        if t in seen:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        out[t] -= frequency * counts[t] + presence * (counts[t] > 0)
    return torch.tensor(out)


# ---- greedy -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_fast_path_is_argmax(dtype):
    logits = random_logits(8).to(dtype)
    rows = [make_row(SamplingParams.greedy()) for _ in range(8)]
    out = sample(logits, rows)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t == Sample(t.token_id, None, None) for t in out)


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    logits = random_logits(6)
    rows = [
        make_row(SamplingParams(temperature=0.0) if i % 2 else SamplingParams(), seed=i)
        for i in range(6)
    ]
    out = sample(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [out[i].token_id for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


def test_top_k_1_is_greedy_at_any_temperature():
    logits = random_logits(16)
    rows = [make_row(SamplingParams(temperature=5.0, top_k=1), seed=i) for i in range(16)]
    assert [t.token_id for t in sample(logits, rows)] == logits.argmax(-1).tolist()


def test_input_logits_not_modified():
    logits = random_logits(4)
    before = logits.clone()
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, min_tokens=3, top_k=5)
    rows = [make_row(params, seed=i, prompt=range(10), output=[1, 2], eos=(0,)) for i in range(4)]
    sample(logits, rows)
    assert torch.equal(logits, before)


# ---- penalties and min_tokens ------------------------------------------------------------


def test_penalties_match_reference():
    logits = random_logits(5)
    cases = [
        # (prompt, output, repetition, presence, frequency)
        ([1, 2, 3], [3, 3, 4, 5, 5, 5], 1.3, 0.0, 0.0),
        ([1, 2, 3], [3, 3, 4, 5, 5, 5], 1.0, 0.7, 0.0),
        ([1, 2, 3], [3, 3, 4, 5, 5, 5], 1.0, 0.0, -0.4),
        ([7, 7, 9, 63], [0, 9, 9, 10], 0.6, -1.5, 2.0),
        ([], [], 1.0, 0.0, 0.0),  # no penalty: row must come back unchanged
    ]
    rows = [
        make_row(
            SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f),
            prompt=prompt,
            output=output,
        )
        for prompt, output, r, p, f in cases
    ]
    got = process_logits(logits, rows)
    want = torch.stack(
        [reference_penalties(logits[i], *case) for i, case in enumerate(cases)]
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[4], logits[4])


def test_repetition_penalty_steers_greedy_away_from_seen_token():
    logits = torch.tensor([[4.0, 3.0, -1.0, 0.5]])
    rows = [make_row(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=[0])]
    assert sample(logits, rows)[0].token_id == 1  # 4.0 / 2 = 2.0 < 3.0


def test_penalty_on_negative_logit_multiplies():
    logits = torch.tensor([[-1.0, -2.5, -3.0]])
    rows = [make_row(SamplingParams(temperature=0.0, repetition_penalty=3.0), output=[0])]
    assert sample(logits, rows)[0].token_id == 1  # -1 * 3 = -3 < -2.5


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 7.0, 2.0]])  # eos 2 > stop 3 > 4
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,))

    def greedy_after(output, params=params):
        return sample(logits, [make_row(params, output=output, eos=(2,))])[0].token_id

    assert greedy_after([1, 1]) == 4  # both eos and the stop id are masked
    assert greedy_after([1, 1, 1]) == 2  # min_tokens reached: eos wins again
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(3,), ignore_eos=True)
    assert greedy_after([1], ignoring) == 2  # eos is never a stop, so it is not masked


def test_min_tokens_masks_eos_when_sampling():
    eos = 0
    params = SamplingParams(min_tokens=5, temperature=1.0)
    logits = FOUR.expand(500, -1).clone()
    rows = [make_row(params, seed=i, output=[1, 2], eos=(eos,)) for i in range(500)]
    counts = Counter(t.token_id for t in sample(logits, rows))
    assert eos not in counts and set(counts) == {1, 2, 3}


# ---- filters and temperature -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    counts = draw_counts(logits, SamplingParams(temperature=temperature))
    assert chi_square(counts, (logits / temperature).softmax(-1)) < CHI2_LIMIT


def test_wrong_temperature_would_be_detected():
    # Guards the chi-square check itself: temperature 0.5 draws do not look like temperature 1.
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -2.0])
    counts = draw_counts(logits, SamplingParams(temperature=0.5))
    assert chi_square(counts, logits.softmax(-1)) > 10 * CHI2_LIMIT


# 1e-9 is below float32 resolution of 1 - top_p, so even the top token's mass is "<= 1 - p".
@pytest.mark.parametrize("top_p", [1e-6, 1e-9])
def test_tiny_top_p_keeps_only_the_top_token(top_p):
    # Flipped so that the top token is not index 0, where argmax lands on all-NaN rows.
    counts = draw_counts(FOUR.flip(0), SamplingParams(top_p=top_p), draws=500)
    assert set(counts) == {3}


def test_top_p_keeps_the_nucleus_renormalised():
    # Sorted cumulative mass 0.5, 0.8, 0.95, 1.0: top_p 0.7 keeps tokens 0 and 1.
    counts = draw_counts(FOUR, SamplingParams(top_p=0.7))
    assert set(counts) == {0, 1}
    assert chi_square(counts, torch.tensor([0.5, 0.3, 0, 0]) / 0.8) < CHI2_LIMIT


def test_top_k_keeps_k_most_likely_renormalised():
    counts = draw_counts(FOUR, SamplingParams(top_k=2))
    assert set(counts) == {0, 1}
    assert chi_square(counts, torch.tensor([0.5, 0.3, 0, 0]) / 0.8) < CHI2_LIMIT


@pytest.mark.parametrize("top_k", [0, -1, 4, 1000])
def test_top_k_disabled_or_larger_than_vocab_keeps_everything(top_k):
    counts = draw_counts(FOUR, SamplingParams(top_k=top_k))
    assert chi_square(counts, FOUR.softmax(-1)) < CHI2_LIMIT


def test_min_p_drops_tokens_below_fraction_of_max():
    # min_p 0.2 * max prob 0.5 = 0.1: only the 0.05 token goes.
    counts = draw_counts(FOUR, SamplingParams(min_p=0.2))
    assert set(counts) == {0, 1, 2}
    assert chi_square(counts, torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95) < CHI2_LIMIT


def test_min_p_applies_after_temperature():
    # At temperature 0.5 probs become ~[.69, .25, .06, .007]: min_p 0.2 cuts at ~0.14.
    counts = draw_counts(FOUR, SamplingParams(min_p=0.2, temperature=0.5), draws=1000)
    assert set(counts) == {0, 1}


def test_filters_combine_in_one_batch():
    params = [
        SamplingParams(top_k=1, temperature=1.0),
        SamplingParams(top_p=0.7),
        SamplingParams(min_p=0.2),
        SamplingParams(top_k=3, top_p=0.9),  # top-3 mass 0.95, nucleus 0.9 of that: {0, 1, 2}
    ]
    draws = 400
    logits = FOUR.expand(draws * len(params), -1).clone()
    rows = [make_row(p, seed=i) for i in range(draws) for p in params]
    tokens = [t.token_id for t in sample(logits, rows)]
    kept = [set(tokens[j :: len(params)]) for j in range(len(params))]
    assert kept == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2}]


# ---- determinism -------------------------------------------------------------------------


def run_steps(target_seed, companions, steps=20, vocab=VOCAB):
    """Sample the target row for `steps` steps, optionally beside 5 random companion rows."""
    target = SamplingParams(temperature=0.9, top_p=0.95, presence_penalty=0.3, seed=target_seed)
    target_row = make_row(target, seed=target.seed, prompt=[1, 2, 3])
    noise = torch.Generator().manual_seed(99)  # companion logits/params; independent of target
    companion_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=10),
        SamplingParams(min_p=0.1, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0.5, min_tokens=30, max_tokens=64),
        SamplingParams(),
    ]
    tokens = []
    for step in range(steps):
        target_logits = random_logits(1, vocab, seed=step)
        if companions:
            # Companion rows are fresh each step with their own seeds and random logits.
            others = [
                make_row(p, seed=1000 * step + j, output=[step, j], eos=(0,))
                for j, p in enumerate(companion_params)
            ]
            other_logits = torch.randn(5, vocab, generator=noise) * 3
            logits = torch.cat([other_logits[:3], target_logits, other_logits[3:]])
            out = sample(logits, others[:3] + [target_row] + others[3:])[3]
        else:
            out = sample(target_logits, [target_row])[0]
        tokens.append(out.token_id)
        target_row.output_token_ids.append(out.token_id)
    return tokens


def test_seeded_row_is_independent_of_batch_composition():
    alone = run_steps(1234, companions=False)
    in_batch = run_steps(1234, companions=True)
    assert alone == in_batch
    # ...and the seed matters, so the equality above is not vacuous.
    assert run_steps(4321, companions=False) != alone


def test_same_seed_same_tokens_random_seed_differs():
    def tokens(seed):
        rows = [make_row(SamplingParams(), seed=seed) for _ in range(1)]
        rows[0].generator = make_generator(seed, "cpu")
        return [sample(random_logits(1, seed=s), rows)[0].token_id for s in range(30)]

    assert tokens(7) == tokens(7)
    assert tokens(None) != tokens(None)  # OS entropy: equal only with probability ~64**-30


# ---- logprobs ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_and_top_sorted(dtype):
    logits = random_logits(4).to(dtype)
    raw = logits.float().log_softmax(-1)
    params = [
        SamplingParams(logprobs=5, temperature=0.7, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(),  # no logprobs requested
        SamplingParams(logprobs=3, temperature=0.0, presence_penalty=2.0),
    ]
    rows = [make_row(p, seed=i, prompt=[1, 2], output=[3, 3]) for i, p in enumerate(params)]
    out = sample(logits, rows)

    for i, (p, tok) in enumerate(zip(params, out)):
        if p.logprobs is None:
            assert tok.logprob is None and tok.top_logprobs is None
            continue
        assert tok.logprob == pytest.approx(raw[i, tok.token_id].item(), abs=1e-6)
        assert len(tok.top_logprobs) == p.logprobs
        values = [v for _, v in tok.top_logprobs]
        assert values == sorted(values, reverse=True)
        want_values, want_ids = raw[i].topk(p.logprobs)
        assert [t for t, _ in tok.top_logprobs] == want_ids.tolist()
        assert values == pytest.approx(want_values.tolist(), abs=1e-6)
    assert out[1].top_logprobs == []


def test_logprobs_ignore_penalties():
    # The penalty moves greedy off token 0, but token 0 keeps its raw (unpenalised) logprob.
    logits = torch.tensor([[4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=1)
    out = sample(logits, [make_row(params, prompt=[0])])[0]
    raw = logits.log_softmax(-1)[0]
    assert out.token_id == 1
    assert out.logprob == pytest.approx(raw[1].item())
    assert out.top_logprobs == [(0, pytest.approx(raw[0].item()))]


# ---- fast filters against a full-sort reference -------------------------------------------

INF = float("inf")


def reference_filter(row, params):
    """One row through temperature, min_p, top_k, top_p the straightforward way: sort it all.

    top_p ranks tokens by value, ties by lower token id, and drops each token whose tail mass
    (row total minus the float64 mass ranked above it, in float32) is <= 1 - top_p; the top
    token always stays.
    """
    x = row / torch.tensor(params.temperature)
    if params.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < torch.tensor(params.min_p) * probs.max(), -INF)
    if 0 < params.top_k < len(x):
        kth = x.sort(descending=True).values[params.top_k - 1]
        x = x.masked_fill(x < kth, -INF)
    if params.top_p < 1.0:
        probs = x.softmax(-1)
        total = probs.sum(dtype=torch.float64).item()
        values, probs = x.tolist(), probs.tolist()
        ranking = sorted(range(len(values)), key=lambda t: (-values[t], t))
        tails, above = [], 0.0
        for t in ranking:
            tails.append(total - above)
            above += probs[t]
        keep = torch.tensor(tails, dtype=torch.float64).float() > 1 - torch.tensor(params.top_p)
        keep[0] = True
        dropped = torch.ones(len(values), dtype=torch.bool)
        dropped[torch.tensor(ranking)[keep]] = False
        x = x.masked_fill(dropped, -INF)
    return x


def legacy_filter(row, params):
    """The sampler's former top_k/top_p: an ascending sort, dropping while cum <= 1 - top_p."""
    x = (row / torch.tensor(params.temperature))[None]
    vocab = x.shape[1]
    if params.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < torch.tensor(params.min_p) * probs.amax(-1, True), -INF)
    sorted_x, order = x.sort(-1)
    if 0 < params.top_k < vocab:
        kth = sorted_x[:, vocab - params.top_k : vocab - params.top_k + 1]
        sorted_x = sorted_x.masked_fill(sorted_x < kth, -INF)
    cum = sorted_x.softmax(-1).cumsum(-1)
    drop = cum <= 1 - torch.tensor(params.top_p)
    drop[:, -1] = False
    sorted_x = sorted_x.masked_fill(drop, -INF)
    return torch.empty_like(sorted_x).scatter_(1, order, sorted_x)[0]


def logits_zoo(vocab, seed):
    """Rows whose top_p=0.9 nuclei range from 1 token to most of the vocab, with many ties."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for sigma in (0.3, 1.0, 2.0, 4.0, 8.0):  # smooth: nuclei from thousands down to a few
        rows.append(torch.randn(vocab, generator=g) * sigma)
    peaked = torch.randn(vocab, generator=g) * 2
    peaked[torch.randint(0, vocab, (20,), generator=g)] += 12
    rows.append(peaked)
    rows.append(torch.randint(0, 4, (vocab,), generator=g).float())  # four huge tie groups
    rows.append(torch.randint(0, 60, (vocab,), generator=g).float() / 6)  # many tie groups
    rows.append(torch.zeros(vocab))  # one tie group: ranking is by token id alone
    head_tie = torch.randn(vocab, generator=g)
    head_tie[torch.randint(0, vocab, (300,), generator=g)] = 9.0  # nucleus ends inside the tie
    rows.append(head_tie)
    masked = torch.randn(vocab, generator=g) * 3
    masked[torch.randint(0, vocab, (vocab // 2,), generator=g)] = -INF  # min_tokens-style holes
    rows.append(masked)
    few = torch.full((vocab,), -INF)
    few[torch.randint(0, vocab, (40,), generator=g)] = torch.randn(40, generator=g)
    rows.append(few)  # fewer finite tokens than the first candidate round
    return torch.stack(rows)


FILTERS = [
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_k=50, temperature=1.3),
    SamplingParams(top_k=700),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.5, temperature=0.6),
    SamplingParams(top_p=0.999),
    SamplingParams(top_p=0.05),
    SamplingParams(top_p=0.9, top_k=50),
    SamplingParams(top_p=0.95, top_k=2000),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.2, top_p=0.8, top_k=100, temperature=1.5),
]


def zoo_batch(vocab, seed):
    logits = logits_zoo(vocab, seed)
    pairs = [(r, p) for r in range(len(logits)) for p in FILTERS]
    return logits[[r for r, _ in pairs]], [p for _, p in pairs]


# top_p `topk` rounds: None ships as is; () sends every row to the histogram bound.
@pytest.mark.parametrize("candidates", [None, (2, 8, 32), (1000,), ()])
@pytest.mark.parametrize("vocab", [4096, 3000])
def test_filters_keep_exactly_the_full_sort_reference_set(monkeypatch, candidates, vocab):
    from tokenloom.kernels import sampling

    if candidates is not None:
        monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", candidates)
    logits, params = zoo_batch(vocab, seed=vocab)
    got = sampling.filter_logits(logits, params)
    want = torch.stack([reference_filter(row, p) for row, p in zip(logits, params)])
    assert torch.equal(got, want)  # same values, same -inf pattern
    # The zoo must reach every round: nuclei within 64, within 1024, and beyond.
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1 and p.top_k in (0, 2000)]
    sizes = [int(want[i].isfinite().sum()) for i in top_p_rows]
    assert min(sizes) == 1 and any(64 < s < 1024 for s in sizes) and max(sizes) > 1024


def test_fast_filters_match_the_previous_implementation_on_tie_free_logits():
    # Old and new differ only where the old sort's order among equal logits or a float32
    # rounding of the cumulative mass decided; continuous random logits hit neither.
    g = torch.Generator().manual_seed(5)
    logits = torch.cat([torch.randn(8, 5000, generator=g) * s for s in (1.0, 3.0, 6.0)])
    for params in FILTERS:
        got = filter_logits(logits, [params] * len(logits))
        want = torch.stack([legacy_filter(row, params) for row in logits])
        assert torch.equal(got, want), params


def test_sampled_tokens_match_reference_draw():
    """Same token as the reference filters followed by the documented noise draw."""
    vocab = 4096
    logits, params = zoo_batch(vocab, seed=11)
    params[3] = SamplingParams(temperature=0.0)  # a greedy row in the mix
    rows = [make_row(p, seed=100 + i) for i, p in enumerate(params)]
    got = [t.token_id for t in sample(logits, rows)]
    want = []
    for i, (row, p) in enumerate(zip(logits, params)):
        if p.is_greedy:
            want.append(int(row.argmax()))
            continue
        noise = torch.empty(vocab).exponential_(generator=make_generator(100 + i, "cpu"))
        probs = reference_filter(row, p).softmax(-1)
        want.append(int((probs / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax()))
    assert got == want


def test_fast_paths_do_not_sort_the_vocabulary(monkeypatch):
    vocab = 4096
    sorted_sizes = []
    real_sort = torch.Tensor.sort

    def spy(self, *args, **kwargs):
        sorted_sizes.append(self.shape[-1])
        return real_sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", spy)
    g = torch.Generator().manual_seed(3)
    peaked = torch.randn(6, vocab, generator=g)
    peaked[:, :10] += 15  # top_p=0.9 nucleus within the first candidate round
    cheap = [
        SamplingParams(temperature=0.8),
        SamplingParams(top_k=50),
        SamplingParams(min_p=0.05),
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.9, top_k=50),
        SamplingParams(top_p=0.99, top_k=1000),
    ]
    sample(peaked, [make_row(p, seed=i) for i, p in enumerate(cheap)])
    assert sorted_sizes and max(sorted_sizes) <= 64
    # A broad nucleus (~1000 tokens here) is bounded by the histogram: still no full sort.
    sorted_sizes.clear()
    broad = torch.randn(1, vocab, generator=g) * 2
    sample(broad, [make_row(SamplingParams(top_p=0.9))])
    assert len(sorted_sizes) == 1 and sorted_sizes[0] < vocab / 2
    # One tie across the whole vocab: all of it is the candidate set.
    sorted_sizes.clear()
    sample(torch.zeros(1, vocab), [make_row(SamplingParams(top_p=0.9))])
    assert sorted_sizes == [vocab]


def test_argmax_rows_matches_torch_argmax_on_ties_nan_and_inf():
    from tokenloom.kernels.sampling import argmax_rows

    x = torch.randn(6, 50)
    x[0, [3, 9]] = float("nan")           # first NaN wins
    x[1] = float("-inf")                 # all masked: index 0
    x[2] = 1.0                           # all tied: first index
    x[3, [7, 8]] = float("inf")          # tied +inf: first
    x[4, 2], x[4, 1] = float("nan"), float("inf")
    for t in (x, x[:, ::2], x.to(torch.bfloat16)):
        assert argmax_rows(t).tolist() == t.argmax(-1).tolist()
