"""Prompt logprobs (SamplingParams.prompt_logprobs) from a prefill step's own forward.

A prefill chunk computes the hidden state of every one of its positions; the forward sends
only the sampled rows through the LM head. For a chunk the scheduler marks
(`ScheduledSequence.prompt_logprobs`), position p's logits give prompt token p + 1's
logprob, for each p in the chunk below the prompt's last position (that one's logits give
the first output token, which is sampled as usual). Chunks concatenate: a chunk's last
position gives the next chunk's first token.

Memory: the LM head and log-softmax run over at most MAX_CHUNK_ELEMENTS logits at a time
(rows = MAX_CHUNK_ELEMENTS // vocab), so a long prompt never holds [prompt_len, vocab]; what
is kept per row is its token's logprob and the top-k. The values stay on the device until
`to_messages` (called when the step finishes), so a launched step is not synchronised early.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
import torch

from tokenloom.actors.messages import ExecuteBatch, PromptLogprobs, TokenLogprob

MAX_CHUNK_ELEMENTS = 1 << 24   # fp32 logits at once: 64 MiB (341 rows of a 49,152 vocab)


@dataclasses.dataclass
class PromptRows:
    """The step's rows whose logits give prompt logprobs, grouped by chunk."""
    request_ids: list[str]
    starts: list[int]              # each chunk's first position (PromptLogprobs.start)
    counts: list[int]              # rows of each chunk (its prompt positions but the last)
    ks: list[int]                  # each chunk's request's prompt_logprobs (top-k)
    rows: torch.Tensor             # [R] int64, rows of the flat batch
    targets: torch.Tensor          # [R] int64, the prompt token each row predicts


def plan_rows(batch: ExecuteBatch, seqs: Mapping[str, Any],
              device: torch.device) -> PromptRows | None:
    """The rows of `batch` (flat layout: sequences in order, as batch_inputs lays them out)
    whose logits the marked chunks need; None when no sequence wants any (the common case:
    one pass over the sequences, no tensor built). `seqs`: the runner's per-request state
    (`.row`: its SamplingRow, with the prompt and the params)."""
    if not any(s.prompt_logprobs for s in batch.sequences):
        return None
    rids, starts, counts, kk, rows, targets = [], [], [], [], [], []
    t = 0
    for s in batch.sequences:
        n = len(s.token_ids)
        if s.prompt_logprobs:
            row = seqs[s.request_id].row
            prompt = row.prompt_token_ids
            count = min(s.start_pos + n, len(prompt) - 1) - s.start_pos
            if count > 0:
                rids.append(s.request_id)
                starts.append(s.start_pos)
                counts.append(count)
                kk.append(row.params.prompt_logprobs or 0)
                rows.append(np.arange(t, t + count, dtype=np.int64))
                targets.append(np.asarray(prompt[s.start_pos + 1: s.start_pos + 1 + count],
                                          np.int64))
        t += n
    if not rids:
        return None
    return PromptRows(rids, starts, counts, kk,
                      torch.from_numpy(np.concatenate(rows)).to(device),
                      torch.from_numpy(np.concatenate(targets)).to(device))


@torch.inference_mode()
def compute(model, h: torch.Tensor, plan: PromptRows) -> tuple[torch.Tensor, ...]:
    """(token logprobs [R], top ids [R, k], top logprobs [R, k], token ranks [R]) on the
    device, with k the largest of the step's requests'. `h`: the step's residual stream
    [T, hidden]; `model.logits(h, rows)` gives those rows' fp32 logits."""
    k = max(plan.ks)
    step = max(1, MAX_CHUNK_ELEMENTS // model.spec.vocab_size)
    token_lp, top_ids, top_lp, ranks = [], [], [], []
    for i in range(0, plan.rows.shape[0], step):
        lp = torch.log_softmax(model.logits(h, plan.rows[i:i + step]).float(), dim=-1)  # [c, V]
        tok = lp.gather(1, plan.targets[i:i + step, None])                        # [c, 1]
        token_lp.append(tok[:, 0])
        ranks.append((lp > tok).sum(dim=-1) + 1)
        if k:
            top = lp.topk(k, dim=-1)
            top_lp.append(top.values)
            top_ids.append(top.indices)
        del lp
    token, rank = torch.cat(token_lp), torch.cat(ranks)
    if not k:
        empty = token.new_zeros((token.shape[0], 0))
        return token, empty.long(), empty, rank
    return token, torch.cat(top_ids), torch.cat(top_lp), rank


def to_messages(plan: PromptRows, values: tuple[torch.Tensor, ...]) -> list[PromptLogprobs]:
    """Bring the values home (one transfer each) as one PromptLogprobs per chunk."""
    token, ids, lps, ranks = (v.tolist() for v in values)
    targets = plan.targets.tolist()
    out, r = [], 0
    for rid, start, count, k in zip(plan.request_ids, plan.starts, plan.counts, plan.ks):
        out.append(PromptLogprobs(request_id=rid, start=start, logprobs=[
            TokenLogprob(token_id=targets[i], logprob=token[i], rank=ranks[i],
                         top=list(zip(ids[i][:k], lps[i][:k])) if k else None)
            for i in range(r, r + count)]))
        r += count
    return out
