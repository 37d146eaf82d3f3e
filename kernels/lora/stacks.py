"""Resident LoRA slots on the device, and the delta each projection adds for a mixed batch.

`LoRAStacks` holds `max_loras` slots for every layer's four fused projections (qkv, o,
gate_up, down). Per layer and projection, in the activation dtype:

    a:  [S * R, in]   slot s owns rows s*R .. (s+1)*R  (its A; zero rows past its rank)
    bt: [S * R, out]  slot s owns rows s*R .. (s+1)*R  (its B transposed, the scaling
                      folded in)

Both keep a slot's rows contiguous, so a slot's shrink and expand read one dense block each
(a [out, S*R] B would make a slot's columns a strided slice that every matmul first copies).

R = lora.max_lora_rank x the projection's sub-projections (3 for qkv, 2 for gate_up). A slot
is loaded by copying an adapter's fused pairs in (kernels/lora/peft_adapter.py) and zeroing
the rest, so a slot never leaks a previous adapter's rows.

A step's rows name their slot in `LoRABatch.token_slots` (-1: the base model). The delta of
a projection `LoRADelta(x, out, lora)` is added in one of these ways:
- eager on CPU, one adapter in the step (`groups`): a shrink and an expand over its rows
  and its used rank only — a batch of one adapter pays its own rank, never `max_loras`;
- eager on CPU, several adapters (`span`): the shrink of every slot in the span of those
  present in one matmul, masked per row to its own slot, and one expand: three operations
  per projection whatever the number of adapters (a pair per adapter measured 4 x 4 calls
  of ~40 us each per projection at 4 adapters: op count, not flops, is the cost here);
- static shapes (`groups` None: compiled CPU programs, CUDA graphs): every slot's shrink at
  once, masked per row by slot, then one expand — no host-side grouping, so a captured
  program serves any mix of the resident adapters; it costs all slots' rank;
- on CUDA, a Triton kernel (kernels/gpu/triton_lora.py) that gathers each row's slot
  (BGMV), for both.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tokenloom.kernels.lora.peft_adapter import KINDS, LoRAWeights, fused_shapes
from tokenloom.kernels.models.model_spec import ModelSpec

BASE_SLOT = -1


@dataclasses.dataclass
class LoRABatch:
    """Which adapter each row of a step runs with (AttentionMetadata.lora)."""
    token_slots: torch.Tensor                                 # [T] int64, -1: base model
    # Eager only: (slot, row indices [n] int64, or None for every row) per adapter present
    # (one adapter), or the [lo, hi) slots spanning those present (several); both None: the
    # static path (all slots, masked by token_slots).
    groups: list[tuple[int, torch.Tensor | None]] | None = None
    span: tuple[int, int] | None = None
    # Span path: the row-to-slot masks per slot rank, built once per step, not per layer.
    masks: dict = dataclasses.field(default_factory=dict)

    def span_mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, (hi - lo) * rank]: 1 where a row's slot owns the column, else 0."""
        m = self.masks.get((rank, dtype))
        if m is None:
            lo, hi = self.span
            cols = torch.arange(lo, hi, device=self.token_slots.device).repeat_interleave(rank)
            m = self.masks[(rank, dtype)] = (self.token_slots[:, None] == cols[None, :]).to(dtype)
        return m


def lora_batch(row_slots: list[int], device: torch.device) -> LoRABatch | None:
    """A step's LoRABatch from each token row's slot, or None when no row has an adapter."""
    present = sorted({s for s in row_slots if s != BASE_SLOT})
    if not present:
        return None
    slots = torch.tensor(row_slots, dtype=torch.int64)
    if len(present) > 1:
        return LoRABatch(token_slots=slots.to(device), span=(present[0], present[-1] + 1))
    rows = None if BASE_SLOT not in row_slots else torch.nonzero(slots == present[0]).flatten()
    return LoRABatch(token_slots=slots.to(device),
                     groups=[(present[0], None if rows is None else rows.to(device))])


class LoRADelta(nn.Module):
    """One projection's LoRA delta over the resident slots (views into LoRAStacks)."""

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, rank: int, used: list[int]):
        super().__init__()
        # Buffers (not plain attributes): a compiled program takes them as inputs, so one
        # program serves every layer's slots.
        self.register_buffer("a", a, persistent=False)            # [S*R, in]
        self.register_buffer("bt", bt, persistent=False)          # [S*R, out]
        num_slots = a.shape[0] // rank
        self.register_buffer("col_slot", torch.arange(num_slots, device=a.device)
                             .repeat_interleave(rank), persistent=False)   # [S*R]
        self.rank = rank
        self.used = used      # rows in use per slot (shared with LoRAStacks; eager only)
        self.kernel = None    # CUDA: lora_add_triton(out, x, a, b, token_slots, rank)

    def forward(self, x: torch.Tensor, out: torch.Tensor, lora: LoRABatch) -> torch.Tensor:
        # x: [T, in], out: [T, out] (the base projection's output, added to in place)
        if self.kernel is not None:
            return self.kernel(out, x, self.a, self.bt.T, lora.token_slots[:x.shape[0]],
                               self.rank)
        r = self.rank
        if lora.span is not None:
            lo, hi = lora.span
            s = (x @ self.a[lo * r: hi * r].T) * lora.span_mask(r, x.dtype)   # [T, span*R]
            return out.addmm_(s, self.bt[lo * r: hi * r])
        if lora.groups is None:
            # static: every slot's shrink, rows masked to their own slot's columns
            s = x @ self.a.T                                              # [T, S*R]
            s = s * (lora.token_slots[:x.shape[0], None] == self.col_slot[None, :]).to(s.dtype)
            return out + s @ self.bt
        for slot, rows in lora.groups:
            u = self.used[slot]
            if not u:
                continue
            a = self.a[slot * r: slot * r + u]                            # [u, in]
            bt = self.bt[slot * r: slot * r + u]                          # [u, out]
            if rows is None:
                out.addmm_(x @ a.T, bt)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ bt)
        return out


class LoRAStacks:
    """`max_loras` device slots for every layer's projections."""

    def __init__(self, spec: ModelSpec, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.spec = spec
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.names: list[str | None] = [None] * max_loras   # what each slot holds
        self.used: dict[str, list[int]] = {k: [0] * max_loras for k in KINDS}
        self.rank: dict[str, int] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.bt: dict[str, torch.Tensor] = {}
        for kind, (fan_in, fan_out, subs) in fused_shapes(spec).items():
            r = max_rank * subs
            self.rank[kind] = r
            self.a[kind] = torch.zeros(spec.num_layers, max_loras * r, fan_in, dtype=dtype,
                                       device=self.device)
            self.bt[kind] = torch.zeros(spec.num_layers, max_loras * r, fan_out, dtype=dtype,
                                        device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.bt) for t in d.values())

    def delta(self, layer: int, kind: str) -> LoRADelta:
        return LoRADelta(self.a[kind][layer], self.bt[kind][layer], self.rank[kind],
                         self.used[kind])

    def load(self, slot: int, weights: LoRAWeights) -> None:
        """Copy an adapter into `slot` (its previous contents are overwritten or zeroed)."""
        assert 0 <= slot < self.max_loras, f"slot {slot} out of range 0..{self.max_loras - 1}"
        for kind in KINDS:
            r = self.rank[kind]
            lo = slot * r
            a, bt = self.a[kind], self.bt[kind]
            a[:, lo:lo + r].zero_()
            bt[:, lo:lo + r].zero_()
            used = 0
            for layer, pairs in enumerate(weights.layers):
                pair = pairs.get(kind)
                if pair is None:
                    continue
                la, lb = pair
                u = la.shape[0]
                assert u <= r, f"adapter {weights.name}: {kind} uses {u} rows of {r}"
                a[layer, lo:lo + u].copy_(la.to(self.dtype))
                bt[layer, lo:lo + u].copy_(lb.T.to(self.dtype))
                used = max(used, u)
            self.used[kind][slot] = used
        self.names[slot] = weights.name

    def clear(self, slot: int) -> None:
        for kind in KINDS:
            r = self.rank[kind]
            self.a[kind][:, slot * r:(slot + 1) * r].zero_()
            self.bt[kind][:, slot * r:(slot + 1) * r].zero_()
            self.used[kind][slot] = 0
        self.names[slot] = None
