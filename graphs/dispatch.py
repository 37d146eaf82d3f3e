"""The single place that decides, per step, whether a batch replays a CUDA graph or runs eager.

Pure: no torch. A batch replays a graph when graphs are available and it is decode-only
(every sequence computes exactly one token) with no more sequences than the largest bucket;
it is then padded up to its bucket. Prefill chunks, mixed prefill+decode batches and larger
batches run eager. The dispatcher also keeps the counts an operator needs to tune buckets:
a histogram of decode batch sizes and the padding waste.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from tokenloom.graphs.buckets import PaddedSizeTable

GRAPH = "graph"
EAGER = "eager"


@dataclasses.dataclass(frozen=True)
class Dispatch:
    mode: str            # GRAPH or EAGER
    padded_size: int     # rows the step computes (== batch size when eager)
    reason: str          # why (for stats and debugging)


class Dispatcher:
    """`table` None means graphs are off (CPU, enforce_eager, or capture failed)."""

    def __init__(self, table: PaddedSizeTable | None, disabled_reason: str = "graphs disabled"):
        self.table = table
        self.disabled_reason = disabled_reason
        self.decode_batch_sizes: Counter[int] = Counter()   # every decode-only batch, by size
        self.graph_steps = 0
        self.eager_steps = 0
        self.real_rows = 0
        self.padded_rows = 0
        self.eager_reasons: Counter[str] = Counter()

    def decide(self, num_seqs: int, num_decodes: int, num_tokens: int) -> Dispatch:
        """Pure decision (no bookkeeping): see `record` for the counters."""
        if self.table is None:
            return Dispatch(EAGER, num_tokens, self.disabled_reason)
        if num_decodes != num_seqs or num_tokens != num_seqs:
            return Dispatch(EAGER, num_tokens, "prefill in batch")
        padded = self.table.padded(num_seqs) if num_seqs else None
        if padded is None:
            return Dispatch(EAGER, num_tokens, "larger than the largest bucket")
        return Dispatch(GRAPH, padded, f"bucket {padded}")

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
            # Save this as graphs.histogram_path to derive buckets from real traffic.
            "decode_batch_size_histogram": {str(k): v for k, v in sorted(self.decode_batch_sizes.items())},
        }
