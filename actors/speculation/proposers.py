"""Proposers for speculative decoding, run by the model runner on its compute thread after
a step's tokens are sampled: each returns, per sequence, up to k tokens guessed to come
next, and the distributions they were drawn from (None for a deterministic guess).

- `NgramProposer`: prompt lookup over the sequence's own tokens (actors/speculation/ngram.py).
- `DraftModelProposer` (actors/speculation/draft_model.py): a smaller model sharing the tokenizer.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

from tokenloom.actors.speculation.ngram import propose_ngram


class Proposer(Protocol):
    def propose(self, seqs: Sequence, states: Sequence) -> list[tuple[list[int],
                                                                       torch.Tensor | None]]:
        """For each ScheduledSequence that asked (`propose` > 0; its step has sampled) and
        its runner state (prompt and output token ids, the step's tokens included)."""
        ...


class NgramProposer:
    def __init__(self, n_min: int, n_max: int):
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, seqs, states):
        out = []
        for s, state in zip(seqs, states):
            row = state.row
            tokens = np.concatenate([np.asarray(row.prompt_token_ids, np.int64),
                                     np.asarray(state.output_token_ids, np.int64)])
            out.append((propose_ngram(tokens, s.propose, self.n_min, self.n_max), None))
        return out
