"""The runner's side of multi-LoRA serving: adapters parsed in host memory (an LRU of
`max_cpu_loras`) and copied into the device slots the scheduler assigned.

A slot load (ExecuteBatch.lora_loads) reads the adapter from the host LRU when it is there
(a copy into the slot) and from disk otherwise (parse + check + copy); both are timed and
counted, so the cost of an adapter miss is visible in /metrics and in the benchmark.
Synchronous: called on the compute thread before the step's forward.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from tokenloom.actors.messages import LoRALoadStats
from tokenloom.kernels.lora.peft_adapter import LoRAWeights, load_adapter
from tokenloom.kernels.lora.stacks import LoRAStacks


class LoRACache:
    def __init__(self, stacks: LoRAStacks, max_cpu_loras: int):
        self.stacks = stacks
        self.max_cpu_loras = max_cpu_loras
        self.host: OrderedDict[tuple[str, str], LoRAWeights] = OrderedDict()
        self.stats = LoRALoadStats()

    def weights(self, name: str, path: str) -> LoRAWeights:
        """The adapter's parsed weights, from the host LRU or read from `path`."""
        key = (name, path)
        w = self.host.get(key)
        if w is not None:
            self.host.move_to_end(key)
            return w
        w = load_adapter(name, path, self.stacks.spec, self.stacks.max_rank)
        self.host[key] = w
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
            self.stats.host_evictions += 1
        return w

    def load(self, slot: int, name: str, path: str) -> None:
        t0 = time.perf_counter()
        cached = (name, path) in self.host
        try:
            self.stacks.load(slot, self.weights(name, path))
        except Exception:
            # An empty slot, never a stale one: a row of this slot fails (check) instead of
            # running with another adapter's weights or none.
            self.stacks.clear(slot)
            raise
        dt = time.perf_counter() - t0
        if cached:
            self.stats.from_host += 1
            self.stats.host_seconds += dt
        else:
            self.stats.from_disk += 1
            self.stats.disk_seconds += dt

    def drop(self, name: str) -> None:
        """An unloaded adapter leaves host memory (its slot is reused when next needed)."""
        for key in [k for k in self.host if k[0] == name]:
            del self.host[key]

    def check(self, seqs) -> None:
        """Every row's slot holds an adapter (a failed load left it empty)."""
        for s in seqs:
            if s.lora_slot >= 0 and self.stacks.names[s.lora_slot] is None:
                raise RuntimeError(f"request {s.request_id}: its LoRA slot {s.lora_slot} holds "
                                   "no adapter (the adapter failed to load)")
