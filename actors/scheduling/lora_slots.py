"""Which LoRA adapter each device slot holds, and which waiting requests may enter for it.
Pure (no asyncio, no torch): the scheduler's side of multi-LoRA serving.

The device has `max_loras` slots (kernels/lora/stacks.py). A request whose adapter is
resident runs in its slot; one whose adapter is not needs a slot that no running request
uses, taking the least recently used one (its adapter is evicted: loaded again when next
needed, from the runner's host copy or from disk). Slots in use are derived from the
running requests every step (no reference counts kept by hand), so a request that finishes,
is preempted or fails releases its slot by leaving `running`.

Admission by adapter slots (`admissible`): the waiting requests are walked in the
scheduler's order; each one whose adapter cannot get a slot this step is left out (it waits,
not counted as blocked), and the ones behind it still may enter: an adapter that must wait
for a slot never holds up base-model requests or other adapters' requests. The walk pins
each slot it relies on, so two requests admitted in one step never claim the same slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from tokenloom.actors.scheduling.request import Request


@dataclasses.dataclass
class SlotPlan:
    """The walk's result: the requests that may enter, and the slot each adapter gets."""
    admissible: list[Request]
    slots: dict[str, int]
    waiting_for_slot: int = 0       # requests left out this step for want of a slot
    unknown: list[Request] = dataclasses.field(default_factory=list)  # adapter unloaded


class AdapterSlots:
    def __init__(self, max_loras: int, adapters: dict[str, str] | None = None):
        self.max_loras = max_loras
        self.paths: dict[str, str] = dict(adapters or {})    # the registry: name -> directory
        self.names: list[str | None] = [None] * max_loras    # what each slot holds
        self.last_used = [0] * max_loras
        self._clock = 0
        self.pending_loads: list[tuple[int, str, str]] = []  # for the next batch
        self.num_loads = 0
        self.num_evictions = 0
        self.num_slot_waits = 0
        self.requests_by_adapter: dict[str, int] = {}

    # -- the registry ----------------------------------------------------------------------
    def register(self, name: str, path: str) -> None:
        """Add (or re-point) an adapter. Re-pointing a resident one reloads it when next
        admitted (its slot is forgotten)."""
        if self.paths.get(name) not in (None, path):
            self._forget(name)
        self.paths[name] = path

    def unregister(self, name: str) -> bool:
        """Remove an adapter; running requests finish on their slot, waiting ones fail."""
        self._forget(name)
        return self.paths.pop(name, None) is not None

    def _forget(self, name: str) -> None:
        for s, held in enumerate(self.names):
            if held == name:
                self.names[s] = None

    def resident(self, name: str) -> int | None:
        try:
            return self.names.index(name)
        except ValueError:
            return None

    # -- a step ------------------------------------------------------------------------------
    def touch(self, running: Iterable[Request]) -> set[int]:
        """The slots the running requests use (marked used now)."""
        self._clock += 1
        used = {r.lora_slot for r in running if r.lora_slot >= 0}
        for s in used:
            self.last_used[s] = self._clock
        return used

    def admissible(self, waiting: Sequence[Request], in_use: set[int]) -> SlotPlan:
        """Which of `waiting` (in order) may be admitted as far as slots go; see module doc."""
        slots = {n: s for s, n in enumerate(self.names) if n is not None}
        pinned = set(in_use)
        plan = SlotPlan([], {})
        for req in waiting:
            name = req.lora_name
            if name is None:
                plan.admissible.append(req)
                continue
            if name not in self.paths:
                plan.unknown.append(req)
                continue
            slot = slots.get(name)
            if slot is None:
                free = [s for s in range(self.max_loras) if s not in pinned]
                if not free:
                    plan.waiting_for_slot += 1
                    continue
                slot = min(free, key=lambda s: (self.names[s] is not None, self.last_used[s]))
                slots = {n: s for n, s in slots.items() if s != slot}
                slots[name] = slot
            pinned.add(slot)
            plan.slots[name] = slot
            plan.admissible.append(req)
        self.num_slot_waits += plan.waiting_for_slot
        return plan

    def admit(self, admitted: Iterable[Request], plan: SlotPlan) -> None:
        """The policy admitted these: each adapter request gets its slot (loaded if new)."""
        for req in admitted:
            name = req.lora_name
            if name is None:
                continue
            slot = plan.slots[name]
            if self.names[slot] != name:
                if self.names[slot] is not None:
                    self.num_evictions += 1
                self.names[slot] = name
                self.pending_loads.append((slot, name, self.paths[name]))
                self.num_loads += 1
            req.lora_slot = slot
            self.last_used[slot] = self._clock

    def arrived(self, req: Request) -> None:
        """Count a new request by adapter (/metrics' per-adapter request counts)."""
        if req.lora_name is not None:
            self.requests_by_adapter[req.lora_name] = (
                self.requests_by_adapter.get(req.lora_name, 0) + 1)

    def take_loads(self) -> list[tuple[int, str, str]]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def running_adapters(self, running: Iterable[Request]) -> list[str]:
        return sorted({r.lora_name for r in running if r.lora_name is not None})
