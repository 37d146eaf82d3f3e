"""Static input and output tensors for captured decode graphs, filled in place each step.

A CUDA graph replays fixed kernels on fixed addresses, so every graph reads its inputs from
these tensors (allocated once, at the largest bucket) and writes its logits into one static
output. Graph b uses the first b rows of each. Before a replay, `fill` writes the batch's
rows and pads the rest of the bucket with rows that are harmless:

- token id 0 at position 0;
- KV slot -1: the store kernel skips it, so padding never writes into the cache;
- context length 1 over block-table column 0, which always holds a valid block id (tables
  only ever receive real block ids), so the attention kernel reads one real (irrelevant) key
  and produces a finite result instead of a 0/0 over an empty context.

The five per-row vectors (the fifth: each row's LoRA slot, -1 for the base model and for
padding) share one [5, max_size] tensor so a step costs two host-to-device copies (vectors,
block tables) whatever the batch size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenloom.kernels.forward_context import AttentionMetadata
from tokenloom.kernels.lora.stacks import LoRABatch

if TYPE_CHECKING:  # torch-only at run time (the GPU check runs with just torch + triton)
    from tokenloom.actors.messages import ScheduledSequence

PAD_TOKEN = 0
PAD_SLOT = -1
PAD_CONTEXT = 1

_IDS, _POS, _SLOTS, _LENS, _LORA = range(5)
PAD_LORA_SLOT = -1


class DecodeBuffers:
    def __init__(self, max_size: int, max_blocks_per_seq: int, block_size: int, vocab_size: int,
                 device: torch.device | str):
        self.max_size = max_size
        self.max_blocks = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        vec = torch.zeros((5, max_size), dtype=torch.int64, device=device)
        vec[_SLOTS] = PAD_SLOT
        vec[_LENS] = PAD_CONTEXT
        vec[_LORA] = PAD_LORA_SLOT
        self._vectors = vec
        self.input_ids = vec[_IDS]           # [max_size]
        self.positions = vec[_POS]           # [max_size]
        self.slot_mapping = vec[_SLOTS]      # [max_size]
        self.context_lens = vec[_LENS]       # [max_size]
        self.lora_slots = vec[_LORA]         # [max_size]
        # The model applies LoRA deltas: every program reads lora_slots (static path: all
        # resident slots, masked per row), so one program serves any mix of adapters.
        self.lora = False
        self.block_tables = torch.zeros((max_size, max_blocks_per_seq), dtype=torch.int64,
                                        device=device)
        self.logits_indices = torch.arange(max_size, dtype=torch.int64, device=device)
        self.logits = torch.zeros((max_size, vocab_size), dtype=torch.float32, device=device)
        # Host staging for the per-row vectors (pinned on CUDA so the copy is asynchronous).
        self._host = torch.zeros((5, max_size), dtype=torch.int64,
                                 pin_memory=self.device.type == "cuda")
        # The staging buffer is rewritten only after the previous step's copy has left it.
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None

    @property
    def max_context(self) -> int:
        """The context every graph is captured for (the full block-table width)."""
        return self.max_blocks * self.block_size

    def fill(self, seqs: list[ScheduledSequence], padded: int) -> None:
        """Write one decode token per sequence into rows [0, len(seqs)), padding up to `padded`."""
        n = len(seqs)
        assert 0 < n <= padded <= self.max_size, \
            f"cannot pad {n} rows to {padded} (max {self.max_size})"
        bs = self.block_size
        host = self._host
        if self._copied is not None:
            self._copied.synchronize()
        widest = 1
        rows = []
        for s in seqs:
            assert len(s.token_ids) == 1, f"graph batch row {s.request_id} is not a single decode"
            pos = s.start_pos
            assert len(s.block_table) <= self.max_blocks, (
                f"{s.request_id}: {len(s.block_table)} blocks exceed the graph table width "
                f"{self.max_blocks}")
            rows.append((s.token_ids[0], pos, s.block_table[pos // bs] * bs + pos % bs, pos + 1,
                         getattr(s, "lora_slot", PAD_LORA_SLOT)))
            widest = max(widest, len(s.block_table))
        host[:, :n] = torch.tensor(rows, dtype=torch.int64).T
        host[_IDS, n:padded] = PAD_TOKEN
        host[_POS, n:padded] = 0
        host[_SLOTS, n:padded] = PAD_SLOT
        host[_LENS, n:padded] = PAD_CONTEXT
        host[_LORA, n:padded] = PAD_LORA_SLOT
        self._vectors[:, :padded].copy_(host[:, :padded], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        # Only the columns this batch uses are refreshed: kernels never read a row past its
        # context, and older columns still hold valid block ids (for the masked reference).
        table = torch.zeros((n, widest), dtype=torch.int64)
        for row, s in enumerate(seqs):
            table[row, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
        self.block_tables[:n, :widest].copy_(table, non_blocking=True)

    def meta(self, size: int) -> AttentionMetadata:
        """Attention metadata over the first `size` rows (views: stable addresses)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decodes=size,
            decode_block_tables=self.block_tables[:size],
            decode_context_lens=self.context_lens[:size],
            decode_max_context=self.max_context,
            prefills=[],
            decode_mask=None,          # built inside the graph by the reference, if used
            has_skip_slots=True,
            lora=LoRABatch(self.lora_slots[:size], None) if self.lora else None,
        )
