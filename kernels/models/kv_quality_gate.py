"""The start-up quality gate of a quantized KV cache (`cache.kv_dtype`): a 1-byte format, or
a bf16 / fp16 cache under a float32 model.

The same model runs the same text twice, once with K/V in the model dtype and once in the
cache's format, and the gate compares the two, teacher-forced (every position predicts
the next token from the true prefix):
- greedy agreement: the fraction of positions whose argmax token is the same;
- KL(model-dtype cache || quantized cache) of the next-token distributions, in nats, its
  mean and 99th percentile;
- perplexity of a second, held-out passage under each cache, and its relative change.

The text goes through in chunks of CHUNK tokens, as a chunked prefill does, so every chunk
after the first attends to its prefix through the (quantized) cache, the way decode steps
do; a single prefill would attend to its own fresh keys and hide the quantization.

A mode passes when agreement >= MIN_AGREEMENT, mean KL <= MAX_MEAN_KL and the perplexity
grows by at most MAX_PPL_INCREASE. Measured on SmolLM2-135M in fp32 (docs/kv-quantization.md
has the table): int8 per-block scales sit far inside these limits; the limits are those
of the int8 weight gate, tighter on perplexity, and a wrong scale (the test injects one)
fails all three.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from tokenloom.arith import cdiv
from tokenloom.config.schema import ConfigError
from tokenloom.kernels.forward_context import AttentionMetadata, PrefillSegment
from tokenloom.kernels.kv_quant import KVFormat, kv_dtype_name, kv_format, kv_storage_dtype
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.models.weights import GATE_TOKENS, _read_memo, _write_memo, held_out_ids
from tokenloom.startup_log import startup_log

MIN_AGREEMENT = 0.93
MAX_MEAN_KL = 0.02
MAX_PPL_INCREASE = 0.02     # relative: +2% perplexity
CHUNK = 16
BLOCK = 16
GATE_VERSION = 1   # part of the remembered verdict's key: bump when the measure changes

# The perplexity passage: held out from the gate's comparison text and, like it, written
# for this project.
PERPLEXITY_TEXT = (
    "The bridge had been painted so many times that nobody knew its original colour. Every "
    "spring a crew of four started at the north bank with scrapers and wire brushes, and "
    "by the time they reached the south bank in late autumn the north end had begun to "
    "rust again. The foreman kept a notebook of the bolts they replaced: a number for each "
    "one, the date, and a word about its condition. In thirty years he filled eleven "
    "notebooks. When the city finally proposed a new bridge of weathering steel that would "
    "never need paint, the engineers asked to borrow the notebooks. They found that the "
    "bolts failed in a pattern, always on the side facing the prevailing wind and always "
    "within a few metres of the drains, and they moved the drains in the new design. The "
    "foreman retired the year the old bridge closed. He said the notebooks were the only "
    "part of the job that would outlast the paint."
)


@dataclasses.dataclass(frozen=True)
class KVGateResult:
    mode: str
    positions: int
    agreement: float
    mean_kl: float
    p99_kl: float
    ppl_reference: float
    ppl_quantized: float

    @property
    def ppl_increase(self) -> float:
        return self.ppl_quantized / self.ppl_reference - 1.0

    @property
    def passed(self) -> bool:
        return (self.agreement >= MIN_AGREEMENT and self.mean_kl <= MAX_MEAN_KL
                and self.ppl_increase <= MAX_PPL_INCREASE)

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (f"KV cache {self.mode} quality gate {verdict}: greedy agreement "
                f"{self.agreement:.3f} (>= {MIN_AGREEMENT}), mean KL {self.mean_kl:.5f} nats "
                f"(<= {MAX_MEAN_KL}), p99 KL {self.p99_kl:.5f}, perplexity "
                f"{self.ppl_reference:.3f} -> {self.ppl_quantized:.3f} "
                f"({self.ppl_increase:+.2%}, <= +{MAX_PPL_INCREASE:.0%}), over "
                f"{self.positions} positions against the model-dtype cache")


def chunked_logits(model, ids: list[int], k_fmt: KVFormat | None, v_fmt: KVFormat | None,
                   chunk: int = CHUNK, storage: torch.dtype | None = None) -> torch.Tensor:
    """[len(ids), vocab] fp32 logits, teacher-forced, `chunk` tokens per forward, with
    K/V stored in the given 1-byte formats, or else as `storage` (None: the model dtype)."""
    spec = model.spec
    device = model.embed_tokens.weight.device
    n = len(ids)
    blocks = cdiv(n, BLOCK)
    kv = KVCache.allocate(spec.num_layers, blocks, BLOCK, spec.num_kv_heads, spec.head_dim,
                          storage or model.rope.cos.dtype, device, k_fmt, v_fmt)
    table = torch.arange(blocks, device=device)
    x = torch.tensor(ids, device=device)
    out = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        pos = torch.arange(start, start + m, device=device)
        meta = AttentionMetadata(
            slot_mapping=pos, num_decodes=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int64, device=device),
            decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
            decode_max_context=0, prefills=[PrefillSegment(0, m, start, table)])
        out.append(model(x[start:start + m], pos, kv, meta,
                         torch.arange(m, device=device)).float())
    return torch.cat(out)


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    target = torch.tensor(ids[1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1], target)
    return math.exp(nll.item())


def measure(model, gate_ids: list[int], ppl_ids: list[int], k_fmt: KVFormat | None,
            v_fmt: KVFormat | None, mode: str,
            storage: torch.dtype | None = None) -> KVGateResult:
    if len(gate_ids) < 2 or len(ppl_ids) < 2:
        raise ValueError("the KV quality gate needs at least 2 tokens of each text")
    with torch.inference_mode():
        ref = torch.log_softmax(chunked_logits(model, gate_ids, None, None), -1)
        got = torch.log_softmax(chunked_logits(model, gate_ids, k_fmt, v_fmt,
                                               storage=storage), -1)
        agreement = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0)
        ppl_ref = _perplexity(chunked_logits(model, ppl_ids, None, None), ppl_ids)
        ppl_q = _perplexity(chunked_logits(model, ppl_ids, k_fmt, v_fmt, storage=storage),
                            ppl_ids)
    return KVGateResult(mode=mode, positions=len(gate_ids), agreement=agreement,
                        mean_kl=kl.mean().item(), p99_kl=torch.quantile(kl, 0.99).item(),
                        ppl_reference=ppl_ref, ppl_quantized=ppl_q)


class KVQualityGateError(ConfigError):
    """A quantized KV mode measured too far from the model-dtype cache to serve."""


def apply_kv_gate(model, cache_cfg, tokenizer, digest: str, dtype: torch.dtype,
                  cache_dir: Path | None, rotation: str = "none") -> KVGateResult | None:
    """Gate `cache.kv_dtype` at start-up (None when K/V stay in the model dtype): refuse to
    start on a failure unless `cache.force_kv_dtype`. The verdict is remembered in
    cache_dir/quality_gate.json, keyed by what could change it."""
    storage = kv_storage_dtype(cache_cfg, dtype)
    if not cache_cfg.kv_quantized and storage == dtype:
        return None
    mode = kv_dtype_name(cache_cfg) + ("" if rotation == "none" else f"+{rotation}")
    k_fmt, v_fmt = kv_format(cache_cfg.side_dtype("k")), kv_format(cache_cfg.side_dtype("v"))
    memo_path = Path(cache_dir) / "quality_gate.json" if cache_dir else None
    key = "|".join(["kv", f"v{GATE_VERSION}", digest, mode, str(dtype), torch.__version__,
                    repr(getattr(model, "cpu_kernels", None))])
    memo = _read_memo(memo_path) if memo_path else {}
    if key in memo:
        result = KVGateResult(**memo[key])
        startup_log.info(result.summary() + " (remembered)", **memo[key])
    else:
        limit = max(2, model.rope.cos.shape[0])
        gate_ids = held_out_ids(tokenizer, model.spec.vocab_size, min(GATE_TOKENS, limit))
        ppl_ids = list(tokenizer(PERPLEXITY_TEXT)["input_ids"])[:min(GATE_TOKENS, limit)]
        if len(ppl_ids) < 16 or len(set(ppl_ids)) < 4:
            ppl_ids = gate_ids[::-1]   # a test tokenizer that cannot read English
        result = measure(model, gate_ids, ppl_ids, k_fmt, v_fmt, mode,
                         None if cache_cfg.kv_quantized else storage)
        if memo_path is not None:
            memo[key] = dataclasses.asdict(result)
            _write_memo(memo_path, memo)
        startup_log.info(result.summary(), agreement=result.agreement, mean_kl=result.mean_kl,
                         ppl_increase=round(result.ppl_increase, 5))
    if not result.passed:
        if not cache_cfg.force_kv_dtype:
            raise KVQualityGateError(
                f"cache.kv_dtype {kv_dtype_name(cache_cfg)!r} fails its quality gate: "
                f"{result.summary()}; set "
                "cache.force_kv_dtype = true to serve it anyway", key="cache.kv_dtype")
        startup_log.warning("serving a quantized KV cache that FAILED its quality gate "
                            "(cache.force_kv_dtype)", summary=result.summary())
    return result
