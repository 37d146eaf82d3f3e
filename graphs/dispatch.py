"""The single place that decides, per step, how a batch runs: a decode graph, piecewise
graphs, or eager.

Pure: no torch. A batch replays a decode graph when graphs are available and it is
decode-only (every sequence computes exactly one token) with no more sequences than the
largest bucket; it is then padded up to its bucket. Any other batch (prefill chunks, mixed
prefill+decode, speculative verification, decode batches above the largest bucket) replays
piecewise graphs (graphs/piecewise.py: everything but attention) when they were captured
and its tokens fit the largest token bucket, padded up to its token bucket. The rest runs
eager, with the reason counted. The dispatcher also keeps the counts an operator needs to
tune buckets: a histogram of decode batch sizes and the padding waste.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from tokenloom.graphs.buckets import PaddedSizeTable

GRAPH = "graph"
PIECEWISE = "piecewise"
EAGER = "eager"


@dataclasses.dataclass(frozen=True)
class Dispatch:
    mode: str            # GRAPH, PIECEWISE or EAGER
    padded_size: int     # rows (GRAPH) or tokens (PIECEWISE, EAGER) the step computes
    reason: str          # why (for stats and debugging)


class Dispatcher:
    """`table` None means decode graphs are off (CPU, enforce_eager, or capture failed);
    `token_table` None means piecewise graphs are off (`piecewise_reason` says why)."""

    def __init__(self, table: PaddedSizeTable | None, disabled_reason: str = "graphs disabled",
                 token_table: PaddedSizeTable | None = None,
                 piecewise_reason: str = "prefill in batch"):
        self.table = table
        self.disabled_reason = disabled_reason
        self.token_table = token_table
        self.piecewise_reason = piecewise_reason
        self.piecewise_steps = 0
        self.piecewise_real_tokens = 0
        self.piecewise_padded_tokens = 0
        self.decode_batch_sizes: Counter[int] = Counter()   # every decode-only batch, by size
        self.graph_steps = 0
        self.eager_steps = 0
        self.real_rows = 0
        self.padded_rows = 0
        self.eager_reasons: Counter[str] = Counter()

    def decide(self, num_seqs: int, num_decodes: int, num_tokens: int) -> Dispatch:
        """Pure decision (no bookkeeping): see `record` for the counters."""
        decode_only = num_seqs > 0 and num_decodes == num_seqs and num_tokens == num_seqs
        if self.table is not None and decode_only:
            padded = self.table.padded(num_seqs)
            if padded is not None:
                return Dispatch(GRAPH, padded, f"bucket {padded}")
        if self.token_table is not None and num_tokens:
            padded = self.token_table.padded(num_tokens)
            if padded is not None:
                return Dispatch(PIECEWISE, padded, f"token bucket {padded}")
            return Dispatch(EAGER, num_tokens, "more tokens than the largest token bucket")
        if self.table is None:
            return Dispatch(EAGER, num_tokens, self.disabled_reason)
        if not decode_only:
            return Dispatch(EAGER, num_tokens, self.piecewise_reason)
        return Dispatch(EAGER, num_tokens, "larger than the largest bucket")

    def dispatch(self, num_seqs: int, num_decodes: int, num_tokens: int) -> Dispatch:
        """Decide and record the decision."""
        d = self.decide(num_seqs, num_decodes, num_tokens)
        self.record(d, num_seqs, num_decodes, num_tokens)
        return d

    def record(self, d: Dispatch, num_seqs: int, num_decodes: int, num_tokens: int) -> None:
        if num_seqs and num_decodes == num_seqs and num_tokens == num_seqs:
            self.decode_batch_sizes[num_seqs] += 1
        if d.mode == GRAPH:
            self.graph_steps += 1
            self.real_rows += num_seqs
            self.padded_rows += d.padded_size - num_seqs
        elif d.mode == PIECEWISE:
            self.piecewise_steps += 1
            self.piecewise_real_tokens += num_tokens
            self.piecewise_padded_tokens += d.padded_size - num_tokens
        else:
            self.eager_steps += 1
            self.eager_reasons[d.reason] += 1

    def stats(self) -> dict:
        total = self.real_rows + self.padded_rows
        return {
            "graphs": self.table is not None,
            "capture_sizes": list(self.table.sizes) if self.table else [],
            "graph_steps": self.graph_steps,
            "eager_steps": self.eager_steps,
            "eager_reasons": dict(self.eager_reasons),
            "graph_real_rows": self.real_rows,
            "graph_padded_rows": self.padded_rows,
            "padding_waste_fraction": self.padded_rows / total if total else 0.0,
            "piecewise": self.token_table is not None,
            "piecewise_token_sizes": list(self.token_table.sizes) if self.token_table else [],
            "piecewise_steps": self.piecewise_steps,
            "piecewise_real_tokens": self.piecewise_real_tokens,
            "piecewise_padded_tokens": self.piecewise_padded_tokens,
            "piecewise_padding_waste_fraction": (
                self.piecewise_padded_tokens / (self.piecewise_real_tokens
                                                + self.piecewise_padded_tokens)
                if self.piecewise_steps else 0.0),
            # Save this as graphs.histogram_path to derive buckets from real traffic.
            "decode_batch_size_histogram": {str(k): v for k, v
                                            in sorted(self.decode_batch_sizes.items())},
        }
