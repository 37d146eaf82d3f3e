"""Batched next-token sampling: one call turns a [B, vocab] logits tensor into B tokens.

Order of operations follows vLLM: min_tokens masking -> repetition penalty -> presence/frequency
penalties -> (greedy rows take argmax here) -> temperature -> min_p -> top_k -> top_p ->
`probs / Exponential(1)` then argmax. The exponential noise of each row comes from that row's
own generator, so a seeded request yields the same tokens whatever else shares its batch.

Everything is vectorised across the batch except drawing that noise (one call per sampled row,
because each row owns a generator). The only host sync is the final `.tolist()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple, Sequence

import torch

from tokenloom.actors.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """Everything the sampler needs about one request at this step.

    `generator` is the request's RNG (see `make_generator`); greedy rows may pass None, and a
    sampled row with None falls back to torch's global RNG (not reproducible).
    `eos_token_ids` are masked, with `params.stop_token_ids`, while
    len(output_token_ids) < params.min_tokens; with `ignore_eos` only the stop ids are masked,
    since EOS would not end the request anyway.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()


class SampledToken(NamedTuple):
    """One sampled token. Logprobs are of the raw model logits (before penalties and
    temperature, like vLLM's default); both are None when `params.logprobs` is None."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on `device`, seeded with `seed`, or from OS entropy when `seed` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """Pick one token per row. `logits`: [B, vocab], any float dtype, not modified."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (
        f"logits {tuple(logits.shape)} must be [len(rows)={len(rows)}, vocab]"
    )
    if not any(_needs_full_path(row) for row in rows):
        return [SampledToken(t, None, None) for t in logits.argmax(-1).tolist()]

    raw = logits.to(torch.float32)  # [B, V]; may alias `logits`, never written
    processed = process_logits(raw, rows)  # [B, V], a fresh tensor
    token_ids = processed.argmax(-1)  # [B]; final answer for greedy rows

    sampled_idx = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if sampled_idx:
        sampled_rows = [rows[i] for i in sampled_idx]
        index = torch.tensor(sampled_idx, device=logits.device)
        probs = _filtered_probs(processed[index], [r.params for r in sampled_rows])
        token_ids[index] = _draw(probs, [r.generator for r in sampled_rows])

    return _with_logprobs(raw, token_ids, rows)


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Return a float32 copy of `logits` with min_tokens masking and penalties applied.

    These are the logits greedy rows take the argmax of; temperature and filters come later.
    """
    out = logits.to(torch.float32, copy=True)  # [B, V]
    _mask_min_tokens(out, rows)
    _apply_penalties(out, rows)
    return out


def _needs_full_path(row: SamplingRow) -> bool:
    p = row.params
    return (
        not p.is_greedy
        or p.needs_penalties
        or p.logprobs is not None
        or bool(_min_tokens_banned(row))
    )


def _min_tokens_banned(row: SamplingRow) -> tuple[int, ...]:
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return ()
    return p.stop_token_ids + (() if p.ignore_eos else tuple(row.eos_token_ids))


def _mask_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[1]
    pairs = [
        (i, t) for i, row in enumerate(rows) for t in _min_tokens_banned(row) if t < vocab
    ]
    if pairs:
        row_idx, tok_idx = torch.tensor(pairs, device=logits.device).unbind(1)
        logits[row_idx, tok_idx] = float("-inf")


def _token_counts(
    token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[len(token_lists), vocab] float32 occurrence counts, built with one scatter_add."""
    counts = torch.zeros(len(token_lists), vocab, dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths) == 0:
        return counts
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), device=device)  # [sum(len)]
    owner = torch.repeat_interleave(  # [sum(len)]: which row each token belongs to
        torch.arange(len(token_lists), device=device), torch.tensor(lengths, device=device)
    )
    flat = owner * vocab + tokens  # index into counts viewed as [R * V]
    counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    return counts


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    idx = [i for i, row in enumerate(rows) if row.params.needs_penalties]
    if not idx:
        return
    device, vocab = logits.device, logits.shape[1]
    pen_rows = [rows[i] for i in idx]
    index = torch.tensor(idx, device=device)  # [P]
    x = logits[index]  # [P, V]

    def column(name: str) -> torch.Tensor:  # [P, 1]
        return torch.tensor([getattr(r.params, name) for r in pen_rows], device=device)[:, None]

    output_counts = _token_counts([r.output_token_ids for r in pen_rows], vocab, device)
    if any(r.params.repetition_penalty != 1.0 for r in pen_rows):
        prompt_counts = _token_counts([r.prompt_token_ids for r in pen_rows], vocab, device)
        seen = (prompt_counts + output_counts) > 0  # [P, V]
        rep = column("repetition_penalty")
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - column("frequency_penalty") * output_counts
    x = x - column("presence_penalty") * (output_counts > 0)
    logits[index] = x


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min_p, top_k, top_p; returns probabilities [S, V]."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    x = logits / temperature  # [S, V]

    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]  # [S, 1]
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))

    use_top_k = any(0 < p.top_k < vocab for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        # Work in ascending order so the kept tokens are a suffix of each row.
        sorted_x, order = x.sort(-1)  # [S, V] each
        if use_top_k:
            # Disabled rows keep all V tokens; ties at the k-th value are all kept, as in vLLM.
            k = torch.tensor(
                [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device
            )
            kth = sorted_x.gather(1, (vocab - k)[:, None])  # [S, 1]
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if use_top_p:
            top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
            cum = sorted_x.softmax(-1).cumsum(-1)  # [S, V]
            drop = cum <= 1 - top_p
            drop[:, -1] = False  # the most likely token always survives
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(sorted_x).scatter_(1, order, sorted_x)
    return x.softmax(-1)


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """argmax(probs / E) with E ~ Exponential(1) is a sample from `probs`, without a host sync."""
    noise = torch.empty_like(probs)  # [S, V]
    for i, generator in enumerate(generators):
        noise[i].exponential_(generator=generator)
    # A zero draw would turn a filtered-out token (prob 0) into 0/0 = NaN, which argmax prefers.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(-1)  # [S]


def _with_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[SampledToken]:
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    ids = token_ids.tolist()
    if not wanted:
        return [SampledToken(t, None, None) for t in ids]

    index = torch.tensor(wanted, device=raw.device)
    logprobs = raw[index].log_softmax(-1)  # [L, V]
    chosen = logprobs.gather(1, token_ids[index][:, None])[:, 0].tolist()  # [L]
    k = max(rows[i].params.logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [L, k] each, best first; k may be 0
    top_values, top_ids = top_values.tolist(), top_ids.tolist()

    out = [SampledToken(t, None, None) for t in ids]
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs
        top = list(zip(top_ids[j][:n], top_values[j][:n]))
        out[i] = SampledToken(ids[i], chosen[j], top)
    return out
