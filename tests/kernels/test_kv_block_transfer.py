"""gather_blocks / scatter_blocks (kernels/kv_store.py): whole blocks out of the paged pool
as host bytes and back, for the KV tiers, in fp32 and bf16 (bytes: numpy has no bf16)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels.kv_store import KVCache, gather_blocks, scatter_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_through_host_bytes(dtype):
    kv = KVCache.allocate(3, 10, 4, 2, 8, dtype, "cpu")
    kv.pool.copy_(torch.randn(kv.pool.shape).to(dtype))
    rows = gather_blocks(kv.pool, [7, 2, 5])
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert rows.dtype == torch.uint8 and rows.shape == (3, 3 * 2 * 4 * 2 * 8 * itemsize)
    # One row is one block of every layer's K and V, in [layers, 2, tokens, heads, dim].
    first = rows[0].view(dtype).reshape(3, 2, 4, 2, 8)
    assert torch.equal(first, kv.pool[:, :, 7])
    before = kv.pool.clone()
    scatter_blocks(kv.pool, [0, 1, 9], rows)
    assert torch.equal(kv.pool[:, :, [0, 1, 9]], before[:, :, [7, 2, 5]])
    untouched = [b for b in range(10) if b not in (0, 1, 9)]
    assert torch.equal(kv.pool[:, :, untouched], before[:, :, untouched])
