"""Weight storage modes beyond the model dtype (`model.weight_dtype`), and their quality gate.

"int8": weight-only int8 with per-output-channel scales for every projection and the LM
head (the embedding stays in the model dtype: a lookup reads one row a token), through the
kernels kernel_plan.plan measures fastest here. Before the engine serves, the quantized
model is compared with the fp32 model on a held-out text (quality_gate.py); a mode that
fails refuses to start unless `model.force_quantized` is set. The verdict is remembered in
`cache_dir/quality_gate.json`, keyed by everything that could change it (weights digest,
mode, dtype, torch version, CPU features, chosen kernels), so a warm start skips it.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from tokenloom.config.schema import ConfigError, ModelConfig
from tokenloom.kernels.cpu.features import detect
from tokenloom.kernels.models import quality_gate
from tokenloom.startup_log import startup_log

GATE_TOKENS = 256


class QualityGateError(ConfigError):
    """A quantized weight mode measured too far from fp32 to serve (see the message)."""


def held_out_ids(tokenizer, vocab_size: int, max_tokens: int = GATE_TOKENS) -> list[int]:
    """The gate's text as token ids; a tokenizer that cannot read English (a test model's
    word-level vocabulary: mostly unknown tokens) gets a fixed pseudo-random id sequence."""
    ids = list(tokenizer(quality_gate.HELD_OUT_TEXT)["input_ids"])[:max_tokens]
    unk = getattr(tokenizer, "unk_token_id", None)
    if len(ids) < 16 or (unk is not None and sum(i == unk for i in ids) > len(ids) // 2):
        rng = random.Random(0)
        ids = [rng.randrange(min(3, vocab_size - 1), vocab_size) for _ in range(max_tokens)]
    return ids


def _gate_key(digest: str, cfg: ModelConfig, dtype: torch.dtype, chosen: dict) -> str:
    # "gate2": the gate measures decode steps too (older verdicts did not).
    return "|".join(["gate2", digest, cfg.weight_dtype, str(dtype), torch.__version__,
                     detect().summary(), chosen.get("layers", ""), chosen.get("head", "")])


def _read_memo(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_memo(path: Path, memo: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the gate next time


def apply_weight_dtype(model, model_dir: Path, cfg: ModelConfig, dtype: torch.dtype,
                       device: torch.device, tokenizer, digest: str,
                       cache_dir: Path | None) -> quality_gate.GateResult | None:
    """Quantize `model` in place per cfg.weight_dtype and gate it; None for "auto"."""
    if cfg.weight_dtype == "auto":
        return None
    if device.type != "cpu":
        raise ConfigError(f"model.weight_dtype {cfg.weight_dtype!r} needs model.device cpu "
                          f"(got {device.type}); use 'auto' there", key="model.weight_dtype")
    chosen = model.specialize_cpu(cfg.weight_dtype, blocks=file_blocks(model, model_dir,
                                                                       cfg.weight_dtype))
    memo_path = Path(cache_dir) / "quality_gate.json" if cache_dir else None
    key = _gate_key(digest, cfg, dtype, chosen)
    memo = _read_memo(memo_path) if memo_path else {}
    if key in memo:
        result = quality_gate.GateResult(**memo[key])
        startup_log.info(result.summary() + " (remembered)", **memo[key])
    else:
        result = run_gate(model, model_dir, tokenizer, cfg.weight_dtype)
        if memo_path is not None:
            memo[key] = {f: getattr(result, f) for f in result.__dataclass_fields__}
            _write_memo(memo_path, memo)
        startup_log.info(result.summary(), agreement=result.agreement, mean_kl=result.mean_kl)
    if not result.passed:
        if not cfg.force_quantized:
            raise QualityGateError(
                f"model.weight_dtype {cfg.weight_dtype!r} fails its quality gate: "
                f"{result.summary()}; set model.force_quantized = true to serve it anyway",
                key="model.weight_dtype")
        startup_log.warning("serving a quantized mode that FAILED its quality gate "
                            "(model.force_quantized)", summary=result.summary())
    return result


def file_blocks(model, model_dir: Path, mode: str) -> dict:
    """For q4/q8 on a model converted from a GGUF file (the default model): the file's own
    blocks per module, where they are in the mode's format and dequantize exactly to the
    weights loaded. Other modules are quantized from the dense weights."""
    from tokenloom.kernels.cpu import blocks as blk
    from tokenloom.kernels.cpu.kernel_set import BLOCK_STORAGES, Q4
    from tokenloom.kernels.models import gguf_blocks
    from tokenloom.kernels.models.loader import gguf_source

    if mode not in BLOCK_STORAGES:
        return {}
    source = gguf_source(model_dir)
    if source is None:
        return {}
    found = gguf_blocks.fused(gguf_blocks.read(source, model.spec), model.spec)
    kept, mismatched = {}, []
    for name, b in found.items():
        wanted = blk.Q4Blocks if mode == Q4 and name != "lm_head" else blk.Q8Blocks
        if not isinstance(b, wanted):
            continue
        if gguf_blocks.matching(b, model.get_submodule(name).weight):
            kept[name] = b
        else:
            mismatched.append(name)
    startup_log.info(f"{mode}: {len(kept)} modules use {source.name}'s own blocks as they are"
                     + (f"; {len(mismatched)} did not match the loaded weights and are "
                        f"requantized (e.g. {mismatched[0]})" if mismatched else ""),
                     kept=len(kept), mismatched=len(mismatched))
    return kept


def run_gate(model, model_dir: Path, tokenizer, mode: str) -> quality_gate.GateResult:
    """Load the fp32 reference (plain torch matmuls: the oracle), measure, free it."""
    from tokenloom.kernels.models.loader import load_model

    ids = held_out_ids(tokenizer, model.spec.vocab_size,
                       min(GATE_TOKENS, model.rope.cos.shape[0] - quality_gate.GREEDY_TOKENS))
    reference, _ = load_model(model_dir, torch.float32, torch.device("cpu"),
                              max_positions=len(ids) + quality_gate.GREEDY_TOKENS)
    reference._layout_done = True   # the reference keeps torch's own fp32 matmuls
    try:
        return quality_gate.measure(reference, model, ids, mode)
    finally:
        del reference
