"""Read a PEFT LoRA adapter directory into the fused projections our forward runs.

A PEFT LoRA directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`,
`use_rslora`, ...) and `adapter_model.safetensors`, whose keys name each adapted module:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

PEFT adds `scaling * B @ A @ x` to the module's output, scaling = alpha / r (rsLoRA: alpha /
sqrt(r)). Our layers run q/k/v as one `qkv` matmul and gate/up as one `gate_up` (decoder.py), so
each fused projection gets one A (the sub-projections' A stacked, [sum of ranks, in]) and one
B (each sub-projection's B * scaling placed at its output rows and its own rank columns,
zeros elsewhere): B @ A @ x is then exactly the concatenation of the sub-projections' deltas.

Everything that can be wrong with an adapter is found here, before it reaches a slot: a
missing file, a module the forward has no place for, a shape that does not fit the base
model, a rank over `max_lora_rank`, a PEFT feature the forward does not run (DoRA, biases,
modules_to_save, fan_in_fan_out, per-module alpha). The error names the adapter and the
field; the daemon keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from tokenloom.kernels.models.model_spec import ModelSpec

# Our fused projections, the PEFT module names they are made of, in output order.
FUSED = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
KINDS = tuple(FUSED)
# Checkpoints that store a fused projection (Phi-3's `qkv_proj`, `gate_up_proj`) are
# adapted as one module: its A and B are our fused projection's pair as they are.
STORED_FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
_SUB_KIND = {**{sub: kind for kind, subs in FUSED.items() for sub in subs}, **STORED_FUSED}
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?"
                  r"\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names it and what is wrong."""


def sub_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each PEFT target module of this base model."""
    h, i = spec.hidden_size, spec.intermediate_size
    return {"q_proj": (h, spec.q_size), "k_proj": (h, spec.kv_size),
            "v_proj": (h, spec.kv_size), "o_proj": (spec.q_size, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
            "qkv_proj": (h, spec.q_size + 2 * spec.kv_size), "gate_up_proj": (h, 2 * i)}


def fused_shapes(spec: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """(in features, out features, sub-projections) of each fused projection."""
    subs = sub_shapes(spec)
    return {kind: (subs[names[0]][0], sum(subs[n][1] for n in names), len(names))
            for kind, names in FUSED.items()}


@dataclasses.dataclass
class LoRAWeights:
    """One adapter, ready for a slot: per layer, per fused projection, (A [u, in], B [out, u])
    in fp32 with the scaling folded into B, or absent when the adapter leaves it alone."""
    name: str
    path: str
    rank: int                      # the largest rank of any module
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]       # PEFT module names adapted (sorted)
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for layer in self.layers for a, b in layer.values())


def read_config(name: str, path: Path) -> dict:
    cfg_file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {str(path)!r} is not a directory")
    if not cfg_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is missing in {path}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON: "
                               f"{e}") from e
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    refused = [
        ("use_dora", cfg.get("use_dora"), "DoRA adapters are not supported"),
        ("bias", cfg.get("bias", "none") not in (None, "none"),
         "adapters that train biases are not supported (bias must be 'none')"),
        ("modules_to_save", cfg.get("modules_to_save"),
         "adapters that replace whole modules are not supported"),
        ("fan_in_fan_out", cfg.get("fan_in_fan_out"), "fan_in_fan_out layouts are not supported"),
        ("alpha_pattern", cfg.get("alpha_pattern"), "per-module lora_alpha is not supported"),
    ]
    for key, bad, why in refused:
        if bad:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key}: {why}")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {CONFIG_FILE} field {key!r} must "
                                   f"be a positive number, got {v!r}")
    return cfg


def load_adapter(name: str, path: str | Path, spec: ModelSpec,
                 max_rank: int) -> LoRAWeights:
    """Read and check the adapter at `path` against the base model `spec`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_config(name, path)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is missing in {path}")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {WEIGHTS_FILE}: {e}") from e
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: tensor {key!r} adapts a module the "
                                   "forward cannot apply a LoRA delta to (supported: "
                                   f"{', '.join(_SUB_KIND)})")
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if module not in _SUB_KIND:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: module {module!r} is not supported "
                                   f"(supported: {', '.join(_SUB_KIND)})")
        if not 0 <= layer < spec.num_layers:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key!r} names layer {layer}, but "
                                   f"the base model has {spec.num_layers} layers")
        pairs.setdefault((layer, module), {})[side] = t
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    for layer, module in pairs:
        kind = STORED_FUSED.get(module)
        both = [n for n in FUSED.get(kind, ()) if (layer, n) in pairs]
        if both:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} adapts both "
                                   f"{module} and its part {both[0]}")
    alpha, use_rslora = float(cfg["lora_alpha"]), bool(cfg.get("use_rslora", False))
    shapes = sub_shapes(spec)
    per_layer: list[dict[str, tuple[torch.Tensor, torch.Tensor, float]]] = [
        {} for _ in range(spec.num_layers)]
    max_r = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {where} has lora_"
                                   f"{''.join(ab)} but not its pair")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the base model needs [r, {fan_in}] and [{fan_out}, r] "
                "(an adapter trained for another base model?)")
        if r > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: rank {r} ({where}) is over "
                                   f"lora.max_lora_rank = {max_rank}")
        max_r = max(max_r, r)
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        per_layer[layer][module] = (a.float(), b.float(), scaling)
    layers = [_fuse(subs, shapes) for subs in per_layer]
    targets = tuple(sorted({m for _, m in pairs}))
    return LoRAWeights(name=name, path=str(path), rank=max_r, alpha=alpha,
                       use_rslora=use_rslora, targets=targets, layers=layers)


def _fuse(subs: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
          shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One layer's sub-projection pairs -> (A, B) per fused projection (see module doc)."""
    out = {}
    stored = {kind: module for module, kind in STORED_FUSED.items() if module in subs}
    for kind, names in FUSED.items():
        if kind in stored:
            a, b, scaling = subs[stored[kind]]
            out[kind] = (a, b * scaling)
            continue
        present = [n for n in names if n in subs]
        if not present:
            continue
        used = sum(subs[n][0].shape[0] for n in present)
        fan_in = shapes[names[0]][0]
        fan_out = sum(shapes[n][1] for n in names)
        a = torch.zeros(used, fan_in)
        b = torch.zeros(fan_out, used)
        row = col = 0
        for n in names:
            width = shapes[n][1]
            if n in subs:
                sa, sb, scaling = subs[n]
                r = sa.shape[0]
                a[col:col + r] = sa
                b[row:row + width, col:col + r] = sb * scaling
                col += r
            row += width
        out[kind] = (a, b)
    return out
