"""Turn one scheduled batch (plain lists) into the forward's input tensors.

Pure apart from building tensors: no model, no asyncio. The flat token layout is decodes
first (one token each), then each prefill chunk; `logits_indices` picks the rows that
complete their sequence's known tokens and therefore get a sampled token.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tokenloom.kernels.attention import decode_mask
from tokenloom.kernels.forward_context import AttentionMetadata, PrefillSegment

if TYPE_CHECKING:  # torch-only at run time: the GPU check imports this without msgspec
    from tokenloom.actors.messages import ExecuteBatch


@dataclasses.dataclass
class BatchInputs:
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [S] int64, rows of the flat batch to sample from
    sample_ids: list[str]          # request id of each sampled row, in order
    num_tokens: int


def build_batch_inputs(batch: ExecuteBatch, block_size: int, device: torch.device) -> BatchInputs:
    seqs = batch.sequences
    nd = batch.num_decodes
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    sample_ids: list[str] = []

    # Decodes: one token each, batched attention over padded block tables.
    max_blocks = 0
    dec_lens: list[int] = []
    for s in seqs[:nd]:
        assert len(s.token_ids) == 1, f"decode of {s.request_id} must carry one token"
        pos = s.start_pos
        ids.append(s.token_ids[0])
        positions.append(pos)
        slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
        dec_lens.append(pos + 1)
        max_blocks = max(max_blocks, len(s.block_table))
        if s.sample:
            logits_indices.append(len(ids) - 1)
            sample_ids.append(s.request_id)
    if nd:
        tables = torch.zeros((nd, max_blocks), dtype=torch.int64)
        for row, s in enumerate(seqs[:nd]):
            tables[row, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
        decode_tables = tables.to(device)
        decode_lens = torch.tensor(dec_lens, dtype=torch.int64, device=device)
    else:
        decode_tables = torch.zeros((0, 1), dtype=torch.int64, device=device)
        decode_lens = torch.zeros((0,), dtype=torch.int64, device=device)

    # Prefill chunks: slots computed vectorised per chunk (chunks can be long).
    segments: list[PrefillSegment] = []
    slot_parts = [torch.tensor(slots, dtype=torch.int64)]
    pos_parts = [torch.tensor(positions, dtype=torch.int64)]
    t = len(ids)
    for s in seqs[nd:]:
        n = len(s.token_ids)
        ids.extend(s.token_ids)
        pos = torch.arange(s.start_pos, s.start_pos + n, dtype=torch.int64)
        table = torch.tensor(s.block_table, dtype=torch.int64)
        slot_parts.append(table[pos // block_size] * block_size + pos % block_size)
        pos_parts.append(pos)
        segments.append(PrefillSegment(query_start=t, query_len=n, start_pos=s.start_pos,
                                       block_table=table.to(device)))
        t += n
        if s.sample:
            logits_indices.append(t - 1)
            sample_ids.append(s.request_id)

    max_ctx = max(dec_lens, default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slot_parts).to(device),
        num_decodes=nd,
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
        decode_max_context=max_ctx,
        prefills=segments,
        # Built once per step, shared by every layer.
        decode_mask=decode_mask(decode_lens, -(-max_ctx // block_size) * block_size) if nd else None,
    )
    return BatchInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.cat(pos_parts).to(device),
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sample_ids=sample_ids,
        num_tokens=t,
    )
