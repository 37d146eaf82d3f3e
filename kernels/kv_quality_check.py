"""The runtime quality check of a quantized KV cache: catches a bad scale while serving.

The start-up gate (models/kv_quality_gate.py) measures a format on a fixed text; it cannot
see a scale that goes wrong later (a kernel bug on one shape, a corrupted restore, a
layer whose activations drift past what its format holds). So on a sampled fraction of
decode steps one row's attention is recomputed from full-precision values and compared:

- A *shadow* holds the full-precision K/V, every layer, of the tokens the first decode row
  writes into its current block, from the step a check first picks it until the block
  fills or the row changes (the step's own K/V are in hand when they are stored, so the
  shadow costs one small copy per layer while it runs, and nothing otherwise).
- Every round(1 / fraction)-th decode step is checked, so a fault that shows on every
  write is caught within that many steps. On a checked step, per layer: the row's query
  against its whole context as served (dequantized), and against the same context with
  the shadowed tokens in full precision.
  Two figures: the KL divergence of the two attention distributions (nats, averaged over
  heads: what a bad K scale does), and the relative error of the shadowed K and V rows
  (what a bad V scale does, which the attention weights alone would not show).
- A layer over either budget raises an alarm: logged, counted, and the layer is promoted
  (kv_quant.QuantizedCache.promote: new blocks kept in the model dtype too), up to
  `max_promotions` layers, whose memory the pool reserved at start-up.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from tokenloom.kernels.attention import gather_context
from tokenloom.kernels.kv_quant import QuantizedCache

# Budgets per format (attention KL in nats, relative K/V error) when the config leaves them
# 0: about 8x / 4x the largest value a clean run measured on SmolLM2-135M (fp32, every
# decode step checked, 3,480 layer comparisons each): int8 0.0025 / 0.016, fp8 e4m3
# 0.0081 / 0.031, fp8 e5m2 0.033 / 0.060. A scale off by 25% already shows as a relative
# error of 0.25; a missing or doubled one as 1.0.
AUTO_BUDGETS = {"int8": (0.02, 0.06), "fp8_e4m3": (0.06, 0.12), "fp8_e5m2": (0.25, 0.24)}


def auto_budgets(k_format: str, v_format: str, max_kl: float,
                 max_error: float) -> tuple[float, float]:
    """The configured budgets, the formats' own (the looser of K's and V's) where 0."""
    kl = max(AUTO_BUDGETS[k_format][0], AUTO_BUDGETS[v_format][0])
    err = max(AUTO_BUDGETS[k_format][1], AUTO_BUDGETS[v_format][1])
    return max_kl or kl, max_error or err


@dataclasses.dataclass
class CheckStats:
    steps: int = 0            # decode steps seen
    checks: int = 0           # steps checked
    layer_checks: int = 0     # layer comparisons made
    alarms: int = 0           # layer comparisons over budget
    max_kl: float = 0.0       # the largest attention KL seen (nats)
    max_error: float = 0.0    # the largest relative K/V error seen
    last_kl: float = 0.0      # the last checked step's largest layer KL
    first_alarm_step: int | None = None   # `steps` when the first alarm was raised
    promoted: tuple[int, ...] = ()


class KVQualityCheck:
    def __init__(self, num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                 device: torch.device, *, fraction: float, max_kl: float, max_error: float,
                 max_promotions: int, seed: int = 0):
        self.block_size = block_size
        self.fraction = fraction
        self.max_kl = max_kl
        self.max_error = max_error
        self.max_promotions = max_promotions
        # Every stride-th decode step is checked (from a seeded random phase): a stride,
        # not a coin per step, so a fault is caught within a bounded number of steps.
        self.stride = max(1, round(1 / fraction)) if fraction > 0 else 0
        self._phase = random.Random(seed).randrange(self.stride) if self.stride else 0
        shape = (num_layers, block_size, kv_heads, head_dim)
        self._shadow_k = torch.zeros(shape, dtype=torch.float32, device=device)
        self._shadow_v = torch.zeros(shape, dtype=torch.float32, device=device)
        self._block = -1           # the shadowed block (-1: none)
        self._first = 0            # its first shadowed offset
        self._offset = -1          # the offset written this step (-1: not recording)
        self._last_slot = -1
        self._table: torch.Tensor | None = None
        self._ctx = 0
        self.checking = False      # this step compares (set by begin)
        self.stats = CheckStats()
        self._alarmed: set[int] = set()
        self._promoted: list[int] = []
        self._step_kl = 0.0

    @property
    def recording(self) -> bool:
        return self._offset >= 0

    def begin(self, slot: int | None, table: torch.Tensor | None, ctx: int) -> None:
        """Before a step: the first decode row's cache slot, block table and context length
        (slot None: the step has no decode)."""
        self.checking = False
        self._offset = -1
        if slot is None or slot < 0:
            self._block = -1
            return
        self.stats.steps += 1
        block, offset = divmod(slot, self.block_size)
        check = self.stride > 0 and (self.stats.steps - 1) % self.stride == self._phase
        if block == self._block and slot == self._last_slot + 1:
            self._offset = offset                     # the shadowed row goes on
        elif check:
            self._block, self._first, self._offset = block, offset, offset
        else:
            self._block = -1
            return
        self._last_slot = slot
        self._table, self._ctx = table, ctx
        self.checking = check
        if check:
            self.stats.checks += 1
            self._step_kl = 0.0

    def record(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The step's K/V [T, kv_heads, head_dim] as computed (row 0: the first decode)."""
        if self._offset >= 0:
            self._shadow_k[layer, self._offset] = key[0]
            self._shadow_v[layer, self._offset] = value[0]

    def check(self, layer: int, q: torch.Tensor, key_cache, value_cache, scale: float) -> None:
        """Compare layer `layer`'s attention for row 0 as served with the shadowed one."""
        if not self.checking or not isinstance(key_cache, QuantizedCache):
            return
        if key_cache.promoted and value_cache.promoted:
            return
        bs = self.block_size
        nb = (self._ctx + bs - 1) // bs
        table = self._table[:nb]
        if int(table[-1]) != self._block:
            return
        start = (nb - 1) * bs
        lo, hi = start + self._first, start + self._offset + 1
        k = gather_context(key_cache, table)[: self._ctx].float()      # [ctx, kvh, d]
        v = gather_context(value_cache, table)[: self._ctx].float()
        k_ref, v_ref = k.clone(), v.clone()
        k_ref[lo:hi] = self._shadow_k[layer, self._first: self._offset + 1]
        v_ref[lo:hi] = self._shadow_v[layer, self._first: self._offset + 1]
        kl = _attention_kl(q[0].float(), k, k_ref, scale)
        err = max(_relative_error(k[lo:hi], k_ref[lo:hi]), _relative_error(v[lo:hi], v_ref[lo:hi]))
        s = self.stats
        s.layer_checks += 1
        s.max_kl, s.max_error = max(s.max_kl, kl), max(s.max_error, err)
        self._step_kl = max(self._step_kl, kl)
        s.last_kl = self._step_kl
        if kl > self.max_kl or err > self.max_error:
            s.alarms += 1
            if s.first_alarm_step is None:
                s.first_alarm_step = s.steps
            self._alarmed.add(layer)

    def take_promotions(self) -> list[int]:
        """Layers to promote after this step (each once, within max_promotions)."""
        todo = []
        for layer in sorted(self._alarmed):
            if layer not in self._promoted and len(self._promoted) < self.max_promotions:
                self._promoted.append(layer)
                todo.append(layer)
        self._alarmed.clear()
        self.stats.promoted = tuple(self._promoted)
        return todo


def _attention_kl(q: torch.Tensor, k: torch.Tensor, k_ref: torch.Tensor, scale: float) -> float:
    """KL(ref || served) of one query's attention [H, D] over keys [ctx, kvh, D], averaged
    over heads (grouped-query: head h reads kv head h // (H / kvh))."""
    h, d = q.shape
    kvh = k.shape[1]
    qg = q.view(kvh, h // kvh, d)
    served = torch.log_softmax(torch.einsum("kgd,tkd->kgt", qg, k) * scale, -1)
    ref = torch.log_softmax(torch.einsum("kgd,tkd->kgt", qg, k_ref) * scale, -1)
    return float((ref.exp() * (ref - served)).sum(-1).clamp_min(0).mean())


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm().clamp_min(1e-12))
