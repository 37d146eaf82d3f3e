"""The quality gate of a quantized weight mode: how far its logits move from the fp32 model's
on a held-out text, and whether that is within the stated limits.

Measured teacher-forced over the text (every position predicts the next token from the true
prefix, so one early flip does not cascade), once as one prefill and, over the last
DECODE_POSITIONS positions, once as one-token decode steps: a step's kernels depend on its
row count (a decode row may run a quantized kernel where a prefill runs a dequantized copy,
kernels/cpu/kernel_plan.py), and both must be measured:
- greedy agreement: the fraction of positions whose argmax token equals fp32's;
- per-token divergence: KL(fp32 || quantized) of the next-token distributions, in nats,
  its mean and 99th percentile over positions;
- and, for information, how many tokens of a greedy continuation of the text's start stay
  identical to fp32's (chaotic: one near-tie flips the rest, so it is reported, not gated).

A mode passes when agreement >= MIN_AGREEMENT and mean KL <= MAX_MEAN_KL. Calibrated on
SmolLM2-135M (222 positions): bf16 weights and activations measure 0.991 / 0.0009 nats;
per-channel int8 weights 0.950-0.968 / 0.004-0.006 nats depending on the kernels (those
that round activations to bf16 sit at the low end). The limits leave that spread room and
still stop a broken one: per-channel int4 (the same weights rounded to 15 levels) measures
0.577 / 0.76 nats.
"""

from __future__ import annotations

import dataclasses

import torch

from tokenloom.arith import cdiv
from tokenloom.kernels.forward_context import AttentionMetadata, PrefillSegment
from tokenloom.kernels.kv_store import KVCache

MIN_AGREEMENT = 0.93
MAX_MEAN_KL = 0.02
GREEDY_TOKENS = 32
DECODE_POSITIONS = 48
BLOCK = 16

# Written for this gate (held out from any training set we know of); ~250 tokens of plain
# English for a real tokenizer.
HELD_OUT_TEXT = (
    "The lighthouse keeper kept two logbooks. In the first she wrote the weather every four "
    "hours: wind from the south-west, force five, visibility good, a swell running long from "
    "the Atlantic. In the second she wrote everything else. The supply boat was late again, "
    "the radio battery was low, and the gulls had learned to open the bread tin. On the "
    "third night of the storm the lamp's motor stopped, and she turned the lens by hand for "
    "six hours, counting the seconds between flashes so that the ships would still know "
    "which light they were looking at. When the relief keeper arrived in the morning he "
    "asked why she had not simply called the mainland. She pointed at the radio, then at "
    "the sea, and said that the mainland could do nothing about either of them before "
    "dawn. Years later, when the light was automated and the keepers were gone, a "
    "historian found both logbooks in a drawer. The first was useful for studying the "
    "climate of the coast. The second was the one she read from start to finish, twice, "
    "because it explained why the first one had no gaps."
)


@dataclasses.dataclass(frozen=True)
class GateResult:
    mode: str
    positions: int
    agreement: float          # teacher-forced argmax agreement with fp32
    mean_kl: float            # nats
    p99_kl: float
    greedy_match: int         # tokens of a greedy continuation equal to fp32's
    greedy_tokens: int

    @property
    def passed(self) -> bool:
        return self.agreement >= MIN_AGREEMENT and self.mean_kl <= MAX_MEAN_KL

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"{self.mode} quality gate {verdict}: greedy agreement {self.agreement:.3f} "
                f"(>= {MIN_AGREEMENT}), mean KL {self.mean_kl:.4f} nats (<= {MAX_MEAN_KL}), "
                f"p99 KL {self.p99_kl:.4f}, over {self.positions} positions of held-out text; "
                f"greedy continuation identical for {self.greedy_match}/{self.greedy_tokens} "
                "tokens")


def _kv_for(model, tokens: int) -> tuple[KVCache, torch.Tensor]:
    spec = model.spec
    blocks = cdiv(tokens, BLOCK)
    device = model.embed_tokens.weight.device
    kv = KVCache.allocate(spec.num_layers, blocks, BLOCK, spec.num_kv_heads, spec.head_dim,
                          model.rope.cos.dtype, device)
    return kv, torch.arange(blocks, device=device)


def teacher_forced_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 logits of one prefill over `ids` (position i predicts i+1)."""
    kv, table = _kv_for(model, len(ids))
    device = table.device
    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device), num_decodes=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.int64,
                                                             device=device),
                             decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
                             decode_max_context=0,
                             prefills=[PrefillSegment(0, n, 0, table)])
    x = torch.tensor(ids, device=device)
    return model(x, torch.arange(n, device=device), kv, meta, torch.arange(n, device=device))


def decode_forced_logits(model, ids: list[int], start: int) -> torch.Tensor:
    """[len(ids) - start, vocab] fp32 logits, position i (>= start) predicting i+1, each
    computed by a one-token decode step after a prefill of ids[:start]."""
    kv, table = _kv_for(model, len(ids))
    device = table.device
    meta = AttentionMetadata(slot_mapping=torch.arange(start, device=device), num_decodes=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.int64,
                                                             device=device),
                             decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
                             decode_max_context=0, prefills=[PrefillSegment(0, start, 0, table)])
    model(torch.tensor(ids[:start], device=device), torch.arange(start, device=device), kv, meta,
          torch.tensor([start - 1], device=device))
    rows = []
    for pos in range(start, len(ids)):
        p = torch.tensor([pos], device=device)
        meta = AttentionMetadata(slot_mapping=p, num_decodes=1, decode_block_tables=table[None],
                                 decode_context_lens=p + 1, decode_max_context=pos + 1,
                                 prefills=[])
        rows.append(model(torch.tensor(ids[pos:pos + 1], device=device), p, kv, meta,
                          torch.zeros(1, dtype=torch.int64, device=device)))
    return torch.cat(rows)


def greedy_continuation(model, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt` (prefill, then one decode step per token)."""
    kv, table = _kv_for(model, len(prompt) + steps)
    device = table.device
    n = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device), num_decodes=0,
                             decode_block_tables=torch.zeros(0, 1, dtype=torch.int64,
                                                             device=device),
                             decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
                             decode_max_context=0, prefills=[PrefillSegment(0, n, 0, table)])
    logits = model(torch.tensor(prompt, device=device), torch.arange(n, device=device), kv, meta,
                   torch.tensor([n - 1], device=device))
    out = [int(logits[0].argmax())]
    for pos in range(n, n + steps - 1):
        p = torch.tensor([pos], device=device)
        meta = AttentionMetadata(slot_mapping=p, num_decodes=1, decode_block_tables=table[None],
                                 decode_context_lens=p + 1, decode_max_context=pos + 1,
                                 prefills=[])
        logits = model(torch.tensor(out[-1:], device=device), p, kv, meta,
                       torch.zeros(1, dtype=torch.int64, device=device))
        out.append(int(logits[0].argmax()))
    return out


def measure(reference, candidate, ids: list[int], mode: str,
            greedy_tokens: int = GREEDY_TOKENS) -> GateResult:
    """Compare `candidate` (the quantized model) with `reference` (fp32) on token ids."""
    if len(ids) < 2:
        raise ValueError("the quality gate needs at least 2 tokens of text")
    start = max(1, len(ids) - DECODE_POSITIONS)
    with torch.inference_mode():
        ref = torch.log_softmax(torch.cat([teacher_forced_logits(reference, ids).float(),
                                           decode_forced_logits(reference, ids, start).float()]),
                                -1)
        got = torch.log_softmax(torch.cat([teacher_forced_logits(candidate, ids).float(),
                                           decode_forced_logits(candidate, ids, start).float()]),
                                -1)
        agreement = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0)          # [positions]
        prompt = ids[: max(1, len(ids) // 4)]
        a = greedy_continuation(reference, prompt, greedy_tokens)
        b = greedy_continuation(candidate, prompt, greedy_tokens)
    match = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), greedy_tokens)
    return GateResult(mode=mode, positions=ref.shape[0], agreement=agreement,
                      mean_kl=kl.mean().item(), p99_kl=torch.quantile(kl, 0.99).item(),
                      greedy_match=match, greedy_tokens=greedy_tokens)
