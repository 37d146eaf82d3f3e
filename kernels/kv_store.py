"""The paged KV cache tensors and the store of new keys/values into it.

Layout per layer: key and value caches of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A token's cache slot is `block_id * block_size + offset`; slot -1 means "skip"
(padded rows of a captured CUDA graph write nowhere).

In a quantized mode (`cache.kv_dtype`, kernels/kv_quant.py) the pool is 1-byte and each
layer's K and V are `QuantizedCache` objects over it, with fp32 scales per token and KV
head in `scales` [layers, 2, num_blocks, block_size, kv_heads]; swap, copy-on-write and
the KV tiers move the 1-byte form and its scales.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenloom.kernels.kv_quant import KVFormat, QuantizedCache, make_caches


@dataclasses.dataclass
class KVCache:
    key: list[torch.Tensor]    # per layer [num_blocks, block_size, kv_heads, head_dim]
    value: list[torch.Tensor]
    num_blocks: int
    block_size: int
    # The whole pool [layers, 2, blocks, block_size, kv_heads, head_dim] the views above
    # slice (None when the caches were built some other way, e.g. in unit tests).
    pool: torch.Tensor | None = None
    # Quantized modes: fp32 scales [layers, 2, num_blocks, block_size, kv_heads] (None
    # otherwise).
    scales: torch.Tensor | None = None

    @classmethod
    def allocate(cls, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 k_format: KVFormat | None = None,
                 v_format: KVFormat | None = None,
                 layer_slots: tuple[int, ...] | None = None) -> "KVCache":
        """`dtype` is the model dtype; K and V are stored in it unless a 1-byte format is
        given for both (kv_quant.py). `layer_slots[l]`: the pool slot layer l's K and V
        live in (layer groups share a block's memory, actors/kv/groups.py); None: slot l."""
        # One allocation for the whole pool, viewed per layer: the pool's size is decided
        # once, up front, from the memory budget.
        slots = layer_slots if layer_slots is not None else tuple(range(num_layers))
        num_slots = max(slots) + 1
        shape = (num_slots, 2, num_blocks, block_size, num_kv_heads, head_dim)
        if (k_format is None) != (v_format is None):
            raise ValueError("K and V must both be quantized or both in the model dtype")
        if k_format is not None:
            pool = torch.zeros(shape, dtype=torch.uint8, device=device)
            scales = torch.zeros((num_slots, 2, num_blocks, block_size, num_kv_heads),
                                 dtype=torch.float32, device=device)
            keys, values = make_caches(pool, scales, k_format, v_format, dtype)
            return cls(key=[keys[s] for s in slots], value=[values[s] for s in slots],
                       num_blocks=num_blocks, block_size=block_size, pool=pool, scales=scales)
        pool = torch.zeros(shape, dtype=dtype, device=device)
        return cls(key=[pool[s, 0] for s in slots], value=[pool[s, 1] for s in slots],
                   num_blocks=num_blocks, block_size=block_size, pool=pool)

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def promoted_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.key)
                if isinstance(k, QuantizedCache) and k.promoted]

    def promote_layer(self, layer: int) -> int:
        """Serve `layer` from a model-dtype copy from now on (kv_quant.py); returns the
        bytes the copy takes."""
        return self.key[layer].promote() + self.value[layer].promote()

    def refresh_promoted(self, block_ids: list[int]) -> None:
        """After 1-byte blocks were written from outside (swap-in, a tier restore)."""
        promoted = self.promoted_layers()
        if promoted and block_ids:
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self.pool.device)
            for i in promoted:
                self.key[i].refresh(ids)
                self.value[i].refresh(ids)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (K and V): copy-on-write."""
        device = self.pool.device if self.pool is not None else self.key[0].device
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=device)
        seen = set()   # (layer groups share slots: each slot's cache once)
        for cache in (*self.key, *self.value):
            key = cache.data_ptr() if isinstance(cache, torch.Tensor) else id(cache)
            if key in seen:
                continue
            seen.add(key)
            if isinstance(cache, QuantizedCache):
                cache.copy_blocks(src, dst)
            else:
                cache[dst] = cache[src]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype_bytes: int) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype_bytes


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K/V values rounded into a 2-byte pool's dtype; into fp16 clamped to its largest
    finite value first (an outlier stays large instead of becoming inf, which would make
    its row's attention NaN), as the C++ store does (csrc/row_ops.h)."""
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor, has_skip: bool = False) -> None:
    """Write key/value [T, kv_heads, head_dim] into their slots; slots < 0 are skipped."""
    if isinstance(key_cache, QuantizedCache):
        key_cache.store(key, slot_mapping, has_skip)
        value_cache.store(value, slot_mapping, has_skip)
        return
    kv_heads, head_dim = key.shape[1], key.shape[2]
    if key.dtype != key_cache.dtype:   # fp32 rows into a bf16 / fp16 pool (cache.kv_dtype)
        key, value = to_pool(key, key_cache.dtype), to_pool(value, value_cache.dtype)
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

    def __init__(self, device_pool: torch.Tensor, num_slots: int,
                 scales: torch.Tensor | None = None):
        shape = (device_pool.shape[0], device_pool.shape[1], num_slots, *device_pool.shape[3:])
        pin = device_pool.device.type == "cuda"
        self.data = torch.zeros(shape, dtype=device_pool.dtype, device="cpu", pin_memory=pin)
        # A quantized pool's scales travel with its blocks.
        self.scales = None if scales is None else torch.zeros(
            (scales.shape[0], scales.shape[1], num_slots, *scales.shape[3:]),
            dtype=scales.dtype, device="cpu", pin_memory=pin)
        self.num_slots = num_slots

    @staticmethod
    def slots_for(budget_bytes: int, bytes_per_block: int) -> int:
        return budget_bytes // bytes_per_block if bytes_per_block else 0

    def swap_out(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots: pairs of (block, slot)."""
        blocks = torch.tensor([b for b, _ in pairs], dtype=torch.int64, device=kv.pool.device)
        slots = torch.tensor([s for _, s in pairs], dtype=torch.int64)
        self.data[:, :, slots] = kv.pool.index_select(2, blocks).to("cpu")
        if self.scales is not None:
            self.scales[:, :, slots] = kv.scales.index_select(2, blocks).to("cpu")

    def swap_in(self, kv: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots back into device blocks: pairs of (slot, block)."""
        slots = torch.tensor([s for s, _ in pairs], dtype=torch.int64)
        blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=kv.pool.device)
        kv.pool[:, :, blocks] = self.data.index_select(2, slots).to(kv.pool.device,
                                                                    non_blocking=True)
        if self.scales is not None:
            kv.scales[:, :, blocks] = self.scales.index_select(2, slots).to(kv.pool.device,
                                                                            non_blocking=True)
            kv.refresh_promoted([b for _, b in pairs])


def gather_blocks(pool: torch.Tensor, block_ids: list[int],
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """Whole blocks (every layer's K and V) as host bytes, one row per block: [n, bytes]
    uint8, each row laid out [layers, 2, block_size, kv_heads, head_dim] in the pool's
    dtype (the KV tiers' record payload; bytes, so bf16 needs no numpy dtype), followed
    in a quantized pool by the block's fp32 scales [layers, 2, block_size, kv_heads]."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    blocks = pool.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
    rows = blocks.to("cpu").view(torch.uint8).reshape(len(block_ids), -1)
    if scales is None:
        return rows
    s = scales.index_select(2, idx).movedim(2, 0).contiguous().to("cpu")
    return torch.cat((rows, s.view(torch.uint8).reshape(len(block_ids), -1)), dim=1)


def scatter_blocks(pool: torch.Tensor, block_ids: list[int], rows: torch.Tensor,
                   scales: torch.Tensor | None = None) -> None:
    """The inverse of ``gather_blocks``: write [n, bytes] uint8 rows into those blocks."""
    layers, two, _, *tail = pool.shape
    n = len(block_ids)
    rows = rows.reshape(n, -1)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    value_bytes = pool[:, :, 0].numel() * pool.element_size()
    data = rows[:, :value_bytes].contiguous().view(pool.dtype).reshape(n, layers, two, *tail)
    pool.index_copy_(2, idx, data.permute(1, 2, 0, 3, 4, 5).to(pool.device, non_blocking=True))
    if scales is not None:
        s = rows[:, value_bytes:].contiguous().view(scales.dtype).reshape(
            n, layers, two, *scales.shape[3:])
        scales.index_copy_(2, idx, s.movedim(0, 2).to(pool.device, non_blocking=True))
