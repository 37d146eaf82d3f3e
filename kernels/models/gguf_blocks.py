"""A GGUF file's quantized projections, as blocks for the CPU block kernels, unchanged.

The default model ships as a Q4_1 GGUF (token embedding in Q8_0). The safetensors cache the
loader converts it to holds those blocks dequantized to fp32; `model.weight_dtype = "q4"`
serves the file's own blocks instead, so it computes with exactly the weights the file
ships (no requantization). The blocks are checked against the dense weights before use
(`matching`): a file whose blocks do not dequantize to the loaded weights is not used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.kernels.cpu import blocks as blk
from tokenloom.kernels.models.model_spec import ModelSpec

# GGUF's llama tensor names -> the HF projection they hold.
_ROLES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
          "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}


def llama_unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's conversion of q/k (it interleaves each head's two
    RoPE halves): HF row r is GGUF row index[r]."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(-1)


def read(path: Path, spec: ModelSpec) -> dict[str, blk.Blocks]:
    """The file's Q4_0 / Q4_1 / Q8_0 tensors by HF role: "layers.{i}.{q,k,v,o,gate,up,down}",
    "embed", "head". Tensors in other types are left out (they stay dense)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    out: dict[str, blk.Blocks] = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in blk.GGUF_BLOCK_BYTES or len(t.shape) != 2:
            continue
        cols, rows = int(t.shape[0]), int(t.shape[1])   # GGUF lists the fastest axis first
        raw = torch.from_numpy(np.array(t.data).view(np.uint8)).reshape(rows, -1)
        b = blk.from_gguf(kind, raw, rows, cols)
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _ROLES:
            role = _ROLES[parts[2]]
            if role == "q":
                b = b.rows(llama_unpermute_rows(rows, spec.num_heads))
            elif role == "k":
                b = b.rows(llama_unpermute_rows(rows, spec.num_kv_heads))
            out[f"layers.{parts[1]}.{role}"] = b
        elif t.name == "token_embd.weight":
            out["embed"] = b
        elif t.name == "output.weight":
            out["head"] = b
    return out


def fused(found: dict[str, blk.Blocks], spec: ModelSpec) -> dict[str, blk.Blocks]:
    """Blocks per module of our model (qkv and gate/up fused as the loader fuses them):
    "layers.{i}.self_attn.qkv_proj", ..., "lm_head". A module whose parts are not all in
    blocks of one format is left out."""
    out: dict[str, blk.Blocks] = {}
    for i in range(spec.num_layers):
        p = f"layers.{i}."

        def get(*roles: str) -> blk.Blocks | None:
            parts = [found.get(p + r) for r in roles]
            if any(x is None for x in parts):
                return None
            try:
                return parts[0] if len(parts) == 1 else blk.concat(parts)
            except ValueError:
                return None

        for name, roles in (("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", ("o",)),
                            ("mlp.gate_up_proj", ("gate", "up")), ("mlp.down_proj", ("down",))):
            b = get(*roles)
            if b is not None:
                out[p + name] = b
    head = found.get("head") or (found.get("embed") if spec.tie_word_embeddings else None)
    if head is not None:
        out["lm_head"] = head
    return out


def matching(b: blk.Blocks, dense: torch.Tensor) -> bool:
    """Whether `b` dequantizes to the dense weight the model loaded (same shape, values equal
    up to fp32 rounding)."""
    if tuple(b.shape) != tuple(dense.shape):
        return False
    return torch.allclose(blk.dequantize(b), dense.detach().float(), rtol=1e-5, atol=1e-6)
