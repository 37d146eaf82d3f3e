"""The paged KV cache tensors and the store of new keys/values into it.

Layout per layer: key and value caches of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A token's cache slot is `block_id * block_size + offset`; slot -1 means "skip"
(padded rows of a captured CUDA graph write nowhere).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class KVCache:
    key: list[torch.Tensor]    # per layer [num_blocks, block_size, kv_heads, head_dim]
    value: list[torch.Tensor]
    num_blocks: int
    block_size: int
    # The whole pool [layers, 2, blocks, block_size, kv_heads, head_dim] the views above
    # slice (None when the caches were built some other way, e.g. in unit tests).
    pool: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        # One allocation for the whole pool, viewed per layer: the pool's size is decided
        # once, up front, from the memory budget.
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        pool = torch.zeros(shape, dtype=dtype, device=device)
        return cls(key=[pool[i, 0] for i in range(num_layers)],
                   value=[pool[i, 1] for i in range(num_layers)],
                   num_blocks=num_blocks, block_size=block_size, pool=pool)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (K and V): copy-on-write."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.key[0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.key[0].device)
        for cache in (*self.key, *self.value):
            cache[dst] = cache[src]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype_bytes: int) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor, has_skip: bool = False) -> None:
    """Write key/value [T, kv_heads, head_dim] into their slots; slots < 0 are skipped."""
    kv_heads, head_dim = key.shape[1], key.shape[2]
    kc = key_cache.view(-1, kv_heads, head_dim)
    vc = value_cache.view(-1, kv_heads, head_dim)
    if has_skip:
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    kc.index_copy_(0, slot_mapping, key)
    vc.index_copy_(0, slot_mapping, value)


class HostKVPool:
    """Host-memory slots for swapped-out KV blocks, shaped like the device pool (pinned
    when the device is CUDA, so the copies can overlap). One slot holds one block of every
    layer's K and V."""

    def __init__(self, device_pool: torch.Tensor, num_slots: int):
        shape = (device_pool.shape[0], device_pool.shape[1], num_slots, *device_pool.shape[3:])
        pin = device_pool.device.type == "cuda"
        self.data = torch.zeros(shape, dtype=device_pool.dtype, device="cpu", pin_memory=pin)
        self.num_slots = num_slots

    @staticmethod
    def slots_for(budget_bytes: int, bytes_per_block: int) -> int:
        return budget_bytes // bytes_per_block if bytes_per_block else 0

    def swap_out(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots: pairs of (block, slot)."""
        blocks = torch.tensor([b for b, _ in pairs], dtype=torch.int64, device=kv.pool.device)
        slots = torch.tensor([s for _, s in pairs], dtype=torch.int64)
        self.data[:, :, slots] = kv.pool.index_select(2, blocks).to("cpu")

    def swap_in(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots back into device blocks: pairs of (slot, block)."""
        slots = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=kv.pool.device)
        kv.pool[:, :, blocks] = self.data.index_select(2, slots).to(kv.pool.device,
                                                                    non_blocking=True)


def gather_blocks(pool: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Whole blocks (every layer's K and V) as host bytes, one row per block: [n, bytes]
    uint8, each row laid out [layers, 2, block_size, kv_heads, head_dim] in the pool's
    dtype (the KV tiers' record payload; bytes, so bf16 needs no numpy dtype)."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    blocks = pool.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
    return blocks.to("cpu").view(torch.uint8).reshape(len(block_ids), -1)


def scatter_blocks(pool: torch.Tensor, block_ids: list[int], rows: torch.Tensor) -> None:
    """The inverse of ``gather_blocks``: write [n, bytes] uint8 rows into those blocks."""
    layers, two, _, *tail = pool.shape
    n = len(block_ids)
    data = rows.reshape(n, -1).view(pool.dtype).reshape(n, layers, two, *tail)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    pool.index_copy_(2, idx, data.permute(1, 2, 0, 3, 4, 5).to(pool.device, non_blocking=True))
