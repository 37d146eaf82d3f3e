"""Prompt lookup (n-gram) proposals for speculative decoding. Pure (numpy, no torch).

The sequence so far (prompt + output) often repeats itself: code edits, quoting, summaries
that copy names. If its last n tokens occurred earlier, the tokens that followed that
occurrence are a cheap guess of what comes next. Longer n-grams are tried first (a longer
match is a better predictor); among occurrences of one n-gram the most recent wins (edits
continue where the text was last copied from).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, n_min: int = 2,
                  n_max: int = 4) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the sequence's
    last n tokens, for the largest n in [n_min, n_max] that has one; [] when none does.
    Proposals never run past the end of the sequence (a match near the end proposes
    fewer tokens)."""
    if k <= 0:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    length = len(seq)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        tail = seq[length - n:]
        # Candidate starts i (i + n <= length - 1, so something follows and the match is
        # not the tail itself) whose window ends with the tail's last token.
        ends = np.flatnonzero(seq[n - 1:length - 1] == tail[-1])  # window end - (n - 1)
        for start in ends[::-1]:
            if np.array_equal(seq[start:start + n], tail):
                follow = seq[start + n:start + n + k]
                return follow.tolist()
    return []
