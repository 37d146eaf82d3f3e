"""How a model's layers share the one KV pool: layer groups, each with a block table of its
own. Pure (no torch, no asyncio).

A sliding-window layer reads only the last `window` positions: once a block has fallen out
of the window of every query still to come, its layers will never read it again. So layers
are grouped by attention type, and each group of a request has its own block table over
the one pool: a full-attention group keeps every block; a sliding group frees the blocks
behind its window as the request advances (they go to the prefix cache's free list if
they are cached, to be reused first otherwise), and its table keeps `NULL_BLOCK` in their
place, so the table's index is still the position's block.

One block must serve any group, so every group holds the same number of layers
(`num_slots`: the pool's layer dimension): the smaller attention type sets it, the larger
one is split into several groups of that size (vLLM's hybrid KV cache manager does the
same). Gemma 3's 26 layers (4 full, 22 sliding) make one full group and six sliding
groups of 4 layers (the last using 2 of its 4 slots); Gemma 2's alternating 13 + 13 make
two groups of 13. A model without sliding layers is one group of all its layers: one table
per request, as before there were groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tokenloom.arith import cdiv

# A table entry for a block the group no longer holds (behind a sliding window). The pool
# never hands it out; attention never reads it (the window masks its positions).
NULL_BLOCK = 0


class KVGroups(msgspec.Struct, frozen=True, gc=False):
    """`windows[g]`: group g's sliding window (None: full attention); `layer_group[l]`,
    `layer_slot[l]`: layer l's group and its index in the pool's layer dimension."""
    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @classmethod
    def single(cls, num_layers: int) -> KVGroups:
        """Every layer in one full-attention group (slot = layer)."""
        return cls((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def plan(cls, layer_windows: Sequence[int | None]) -> KVGroups:
        """Groups for layers with these windows (None: full attention). Full-attention
        groups come first: group 0 is the one KV events announce (a router scores a
        request's prefix by it)."""
        n = len(layer_windows)
        kinds: dict[int | None, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            kinds.setdefault(w, []).append(layer)
        if set(kinds) == {None}:
            return cls.single(n)
        size = min(len(layers) for layers in kinds.values())
        windows, group, slot = [], [0] * n, [0] * n
        for w in sorted(kinds, key=lambda w: (w is not None, w or 0)):
            layers = kinds[w]
            for start in range(0, len(layers), size):
                for i, layer in enumerate(layers[start:start + size]):
                    group[layer], slot[layer] = len(windows), i
                windows.append(w)
        return cls(tuple(windows), tuple(group), tuple(slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Some group slides: tables hold NULL_BLOCK entries, which the pool reserves."""
        return any(w is not None for w in self.windows)

    def first_kept_block(self, group: int, num_computed: int, block_size: int) -> int:
        """The first block group `group` still needs when the next position to compute is
        `num_computed`: every later query q >= num_computed reads keys > q - window, so
        blocks ending at or before num_computed - window + 1 are done with."""
        w = self.windows[group]
        if w is None:
            return 0
        return max(0, num_computed - w + 1) // block_size

    def blocks_for(self, num_tokens: int, num_computed: int, block_size: int) -> int:
        """Blocks a request holds, over all groups, with `num_tokens` tokens in its tables
        and the next position to compute at `num_computed`."""
        logical = cdiv(num_tokens, block_size)
        return sum(logical - min(logical, self.first_kept_block(g, num_computed, block_size))
                   for g in range(self.num_groups))
