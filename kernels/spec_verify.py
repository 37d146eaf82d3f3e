"""Verify speculative proposals against the target model's logits, exactly.

One verification step computed the target's logits at a request's last known token and at
each of its k draft tokens: row j is the distribution of the token after draft j (row 0:
after the last known token). Drafts are accepted left to right:

- greedy rows: draft j is accepted while it equals the argmax of row j (the penalised
  logits, as the sampler takes it); the first mismatch emits that argmax instead. The
  output is token for token the output without speculation.
- sampled rows (the rejection rule of Leviathan et al. and Chen et al., 2023): draft j,
  drawn from the proposer's distribution q_j, is accepted with probability
  min(1, p_j(d) / q_j(d)), where p_j is row j after penalties, temperature and the top-k /
  top-p / min-p filters; on rejection a token is drawn from max(p_j - q_j, 0),
  renormalised. Prompt lookup proposes deterministically (q_j is a point mass), so it is
  accepted with probability p_j(d) and a rejection samples p_j without d. Every emitted
  token is then distributed exactly as without speculation.
- if every draft is accepted, one more token is drawn from row k (the "bonus" token).

Row j's sampling history (penalties, min_tokens) includes drafts 0..j-1, so each row is
processed as if those drafts had been sampled. Random numbers come from the request's own
generator, so a seeded request is reproducible for a given schedule of speculation.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from tokenloom.kernels.sampling import (
    Sample,
    SamplingRow,
    _with_logprobs,
    argmax_rows,
    filter_logits,
    process_logits,
)


@dataclasses.dataclass
class Proposal:
    """One request's drafts under verification.

    `rows`: len(drafts) + 1 sampling rows; row j's output history ends with drafts[:j].
    `draft_probs`: [k, vocab] the distributions the drafts were drawn from, or None when
    the proposer is deterministic (a point mass on each draft)."""
    rows: list[SamplingRow]
    drafts: list[int]
    draft_probs: torch.Tensor | None = None


def expand_rows(row: SamplingRow, drafts: Sequence[int]) -> list[SamplingRow]:
    """The k + 1 sampling rows of one request's verification (see Proposal)."""
    out = [row]
    history = list(row.output_token_ids)
    for d in drafts:
        history = history + [d]
        out.append(dataclasses.replace(row, output_token_ids=history))
    return out


def verify(logits: torch.Tensor, proposals: Sequence[Proposal]) -> list[list[Sample]]:
    """`logits`: [sum(len(p.rows)), vocab], the proposals' rows in order. Returns, for each
    proposal, the emitted tokens: its accepted drafts then one more (1..k+1 Samples)."""
    rows = [r for p in proposals for r in p.rows]
    assert logits.dim() == 2 and logits.shape[0] == len(rows), (
        f"logits {tuple(logits.shape)} must be [{len(rows)}, vocab]")
    raw = logits.to(torch.float32)
    processed = process_logits(raw, rows)                       # [R, V]
    greedy_ids = argmax_rows(processed).tolist()                 # [R]
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    probs: dict[int, torch.Tensor] = {}
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        filtered = filter_logits(processed[index], [rows[i].params for i in sampled])
        p_all = filtered.softmax(-1)                             # [len(sampled), V]
        probs = {i: p_all[j] for j, i in enumerate(sampled)}

    out: list[list[Sample]] = []
    first = 0
    for prop in proposals:
        n = len(prop.rows)
        if prop.rows[0].params.is_greedy:
            tokens = _accept_greedy(greedy_ids[first:first + n], prop.drafts)
        else:
            tokens = _accept_sampled([probs[first + j] for j in range(n)], prop)
        out.append(_samples(raw[first:first + len(tokens)], tokens,
                            prop.rows[:len(tokens)]))
        first += n
    return out


def _accept_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    tokens = []
    for j, d in enumerate(drafts):
        if d != argmax[j]:
            return tokens + [argmax[j]]
        tokens.append(d)
    return tokens + [argmax[len(drafts)]]


def _accept_sampled(p: list[torch.Tensor], prop: Proposal) -> list[int]:
    gen = prop.rows[0].generator
    tokens = []
    for j, d in enumerate(prop.drafts):
        q = prop.draft_probs[j] if prop.draft_probs is not None else None
        p_d = float(p[j][d])
        q_d = 1.0 if q is None else float(q[d])
        u = float(torch.rand((), generator=gen, device=p[j].device))
        if q_d > 0 and u * q_d < p_d:       # accept with probability min(1, p/q)
            tokens.append(d)
            continue
        if q is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - q).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:     # p == q: nothing to correct, keep the draft
            residual = p[j].clone()
        return tokens + [_draw(residual, gen)]
    return tokens + [_draw(p[len(prop.drafts)].clone(), gen)]


def _draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """A token drawn with probability proportional to `weights` [V] (overwritten):
    argmax(w / E), E ~ Exponential(1), as the sampler draws."""
    noise = torch.empty_like(weights).exponential_(generator=gen)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return int(argmax_rows(weights.div_(noise)[None])[0])


def _samples(raw: torch.Tensor, tokens: list[int], rows: list[SamplingRow]) -> list[Sample]:
    """Samples with logprobs of the raw logits at each emitted token's row, when wanted."""
    if rows[0].params.logprobs is None:
        return [Sample(t, None, None) for t in tokens]
    ids = torch.tensor(tokens, device=raw.device)
    return _with_logprobs(raw, ids, rows)
