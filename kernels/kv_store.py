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

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> "KVCache":
        # One allocation for the whole pool, viewed per layer: the pool's size is decided
        # once, up front, from the memory budget.
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        pool = torch.zeros(shape, dtype=dtype, device=device)
        return cls(key=[pool[i, 0] for i in range(num_layers)],
                   value=[pool[i, 1] for i in range(num_layers)],
                   num_blocks=num_blocks, block_size=block_size)

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
