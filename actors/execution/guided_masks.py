"""The model runner's guided-decoding masks: one grammar matcher per constrained request
(kept in the runner's per-request state), and the bitmask of a step's sampled rows, filled on
the compute thread after the forward or on a worker thread while it runs.

Contract: `apply` and `mask` leave rows without a constraint untouched, bit for bit, and
cost nothing when no sampled row has one; `fill` reads and writes only the guided requests'
grammar state and runs no parallel torch op, so it may run beside the forward.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenloom.actors.execution.guided import (
    FIELD_OF_KIND,
    GuidedMatcher,
    allocate_bitmask,
    apply_bitmask,
    restrict_draft_probs,
)
from tokenloom.actors.messages import ExecuteBatch

# (the bitmask, the rows it masks, the draft proposals to restrict: (state, row, kept))
Fill = tuple[torch.Tensor, list[int], list]


def no_token_error(p) -> str:
    field = FIELD_OF_KIND[p.guided.kind]
    why = " (min_tokens forbids ending it)" if p.min_tokens else ""
    return (f"the output constraint ({field}) allows no further token{why}; the request "
            f"was ended")


class GuidedMasks:
    """`seqs`: the runner's per-request sampling state (read for `matcher`, `draft_probs`
    and `row.params`); `compiler`: guided decoding's compiler (actors/execution/guided.py;
    shared with the tokenizer actor, which compiled each request's constraint before it got
    here: a cache hit)."""

    def __init__(self, compiler, seqs: dict, overlap: bool):
        self.compiler = compiler
        self._seqs = seqs
        # Masks filled on a worker thread while the forward runs (True), or on the compute
        # thread after it. On by default on CUDA only: there the compute thread spends the
        # forward launching kernels and the host has cores to spare. A CPU forward keeps
        # every core busy (one OpenMP team), so a concurrent fill slows it:
        # benchmarks/structured.py measured 0.877x unconstrained at batch 16 with the
        # overlap against 0.925x without it (2 cores).
        self.overlap = overlap
        self.worker: ThreadPoolExecutor | None = None

    def new_matcher(self, request_id: str, p, outputs: list[int]) -> GuidedMatcher | None:
        if p.guided is None:
            return None
        assert self.compiler is not None, f"{request_id}: guided decoding needs a compiler"
        matcher = GuidedMatcher(self.compiler.compile(p.guided), p.guided.gate)
        if not matcher.replay(outputs):
            matcher.error = no_token_error(p)
        return matcher

    def apply(self, logits: torch.Tensor, sample_ids: list[str],
              drafts: dict[str, list[int]] | None = None) -> torch.Tensor:
        """Mask the logits rows of guided requests to their grammar's allowed tokens (see
        `fill`, then `mask`)."""
        if not any(self._seqs[rid].matcher is not None for rid in sample_ids):
            return logits
        bitmask = allocate_bitmask(len(sample_ids), self.compiler.vocab_size)
        return self.mask(logits, self.fill(bitmask, sample_ids, drafts or {}))

    def fill(self, bitmask: torch.Tensor, sample_ids: list[str],
             drafts: dict[str, list[int]]) -> Fill:
        """Fill `bitmask` for a step's sampled rows; returns it with the rows it applies to
        and the draft-model proposals to restrict to the grammar (`mask` does that). A row
        whose grammar allows no token is left out (the runner's `finish` ends that request).

        `drafts`: the proposals this step verifies (a request's len + 1 rows are
        consecutive). A guided one's verification row j gets the mask of the state after
        drafts 0..j-1; its list is cut, in place, before the first draft the grammar
        refuses (that draft would be rejected for certain; the rows after it are left
        unmasked and unused)."""
        masked, restrict, i = [], [], 0
        while i < len(sample_ids):
            state = self._seqs[sample_ids[i]]
            d = drafts.get(sample_ids[i])
            span = 1 if d is None else len(d) + 1
            matcher, kept = state.matcher, 0   # (ended or failed: `finish` drops or
            if matcher is not None and matcher.error is None and not matcher.terminated:
                kept = matcher.fill_drafts(bitmask, i, d or ())   # reports what comes)
                if kept is None:
                    matcher.error = no_token_error(state.row.params)
                    kept = 0
                else:
                    masked.extend(range(i, i + kept + 1))
                    if kept and state.draft_probs is not None:
                        restrict.append((state, i, kept))
            if matcher is not None and d is not None:
                del d[kept:]
            i += span
        return bitmask, masked, restrict

    @staticmethod
    def mask(logits: torch.Tensor, fill: Fill) -> torch.Tensor:
        bitmask, masked, restrict = fill
        for state, row, kept in restrict:
            state.draft_probs = restrict_draft_probs(state.draft_probs, bitmask, row, kept)
        if not masked:
            return logits
        if logits.dtype != torch.float32:
            logits = logits.float()
        apply_bitmask(logits, bitmask.to(logits.device), masked)
        return logits

    def start(self, batch: ExecuteBatch,
              drafts: dict[str, list[int]]) -> tuple[list[str], Future] | None:
        """Start filling the step's masks on the worker thread, to overlap the forward
        (`overlap`): every guided row's state is known before the step runs (a step with
        guided rows is never launched ahead of the previous step's tokens, which `finish`
        has accepted). Returns (the sampled rows' request ids as the forward will return
        them, the future), or None when no sampled row is guided."""
        ids = [s.request_id for s in batch.sequences if s.sample
               for _ in range(s.num_draft + 1)]
        if self.compiler is None or not any(self._seqs[rid].matcher is not None
                                            for rid in dict.fromkeys(ids)):
            return None
        if self.worker is None:
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-guided")
        bitmask = allocate_bitmask(len(ids), self.compiler.vocab_size)
        return ids, self.worker.submit(self.fill, bitmask, ids, drafts)
