"""Embeddings from the forward the runner runs anyway: a pooling request's prompt hidden
states (SamplingParams.pooling), pooled per request.

A prefill chunk computes the residual stream of every one of its positions (`h` [T, hidden],
as prompt_logprobs.py uses it). For the chunks of a pooling request, its prompt positions'
rows go through the model's final norm (as transformers' base model gives its
`last_hidden_state`, which sentence-transformers pools), then:

- "last": the prompt's last position, in the chunk that completes the prompt. A prefix hit
  never covers it (the scheduler always computes the last prompt token), so last-token
  pooling shares the prefix cache like any request.
- "mean": the sum over every prompt position, accumulated across chunks, over the length.
- "cls": position 0.

Mean and cls need every position from 0 computed by this request: the HTTP layer gives such
requests a cache salt of their own (daemon/openai/embeddings.py), so the only hit they can
meet is their own blocks after a preemption; positions already summed are not summed twice
(`covered`), and a gap (positions never computed here) ends the request with an error.

Contract: `collect` reads `h` before the step returns (piecewise graphs reuse its buffer) and
leaves the values on the device; `messages` brings them home, one transfer per request.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from tokenloom.actors.messages import ExecuteBatch, PooledOutput


@dataclasses.dataclass
class _Sum:
    total: torch.Tensor | None = None   # [hidden] fp32: the sum so far (mean), the first (cls)
    covered: int = 0                     # prompt positions [0, covered) are in it


class Pooler:
    def __init__(self) -> None:
        self._sums: dict[str, _Sum] = {}
        self._ready: list[tuple[str, torch.Tensor | str]] = []   # (request, vector | error)

    def forget(self, request_id: str) -> None:
        self._sums.pop(request_id, None)

    @torch.inference_mode()
    def collect(self, model, h: torch.Tensor, batch: ExecuteBatch,
                seqs: Mapping[str, Any]) -> None:
        """Pool the step's chunks of pooling requests (flat layout, as batch_inputs lays
        them out). `seqs`: the runner's per-request state (`.row`: its SamplingRow)."""
        t = 0
        for s in batch.sequences:
            n = len(s.token_ids)
            state = seqs.get(s.request_id)
            kind = state.row.params.pooling if state is not None else None
            if kind is not None:
                self._chunk(model, h, s.request_id, kind, t, s.start_pos, n,
                            len(state.row.prompt_token_ids))
            t += n

    def _chunk(self, model, h: torch.Tensor, rid: str, kind: str, t: int, start: int, n: int,
               prompt_len: int) -> None:
        end = min(start + n, prompt_len)   # the chunk's prompt positions: [start, end)
        if start >= end:
            return
        if kind == "last":
            if end == prompt_len:
                self._ready.append((rid, model.norm(h[t + end - 1 - start]).float()))
            return
        acc = self._sums.setdefault(rid, _Sum())
        if start > acc.covered:
            self._sums.pop(rid)
            self._ready.append((rid, f"{kind} pooling needs prompt positions "
                                     f"{acc.covered}..{start - 1}, which this request did not "
                                     f"compute (a prefix-cache hit)"))
            return
        lo = acc.covered
        if lo < end:
            rows = model.norm(h[t + lo - start: t + end - start]).float()   # [end - lo, hidden]
            part = rows.sum(dim=0) if kind == "mean" else rows[0]
            if acc.total is None:
                acc.total = part
            elif kind == "mean":
                acc.total = acc.total + part
            acc.covered = end
        if end == prompt_len:
            self._sums.pop(rid)
            self._ready.append((rid, acc.total / prompt_len if kind == "mean" else acc.total))

    def take(self) -> list[tuple[str, torch.Tensor | str]]:
        """The pools completed since the last call (device tensors, or error messages)."""
        ready, self._ready = self._ready, []
        return ready

    @staticmethod
    def messages(ready: list[tuple[str, torch.Tensor | str]]) -> list[PooledOutput]:
        return [PooledOutput(request_id=rid, data=[], error=v) if isinstance(v, str)
                else PooledOutput(request_id=rid, data=v.tolist()) for rid, v in ready]
