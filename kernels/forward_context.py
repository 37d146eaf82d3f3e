"""Per-step attention metadata, passed explicitly through the forward (no global context).

A batch is a flat run of tokens: first one token per decoding sequence, then the prefill
chunks. Decodes are attended together in one batched call; each prefill chunk (which may
start mid-prompt, after earlier chunks or cached blocks) is attended on its own.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class PrefillSegment:
    query_start: int          # index of the chunk's first token in the flat batch
    query_len: int            # tokens in this chunk
    start_pos: int            # position of the chunk's first token in its sequence
    # [num_blocks] int64, the blocks holding positions [0, start_pos + query_len)
    block_table: torch.Tensor
    # [query_len, context_len] additive mask (0 visible, -inf not) in the model's dtype, for
    # a chunk with start_pos > 0: built once per step (attention.with_chunk_masks), not per layer.
    mask: torch.Tensor | None = None
    # The same for the model's sliding-window layers (every chunk), when it has them.
    window_mask: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + self.query_len


@dataclasses.dataclass
class AttentionMetadata:
    # [num_tokens] int64: the cache slot each new token's K/V goes to (-1: skip)
    slot_mapping: torch.Tensor
    num_decodes: int                  # the first num_decodes tokens are single-token decodes
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decodes] int64, including the token being decoded
    decode_max_context: int
    prefills: list[PrefillSegment]
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks*block_size] bool
    decode_window_mask: torch.Tensor | None = None   # the same for sliding-window layers
    # True when slot_mapping may hold -1 (padded rows of a graph bucket): the reference
    # store must then filter (a host sync), a store kernel skips them in place.
    has_skip_slots: bool = False
    # Layer groups 1.. (actors/kv/groups.py): the same step through each group's own block
    # tables (slot mapping, decode tables, prefill segments); None: every layer reads
    # these (one group).
    group_metas: tuple["AttentionMetadata", ...] | None = None
    # [num_tokens] int64: each token's row in the RoPE tables where it is not its position
    # (a longrope model's sequences past the original window read the long set); None.
    rope_rows: torch.Tensor | None = None
    # Which LoRA adapter slot each row runs with (kernels/lora/stacks.LoRABatch); None: every
    # row runs the base model. Carried here because it is per step, like the rest.
    lora: object | None = None
