"""The CPU decode-attention kernel (C++, built on first use) and its fallback.

Decode attention is memory-bound: the torch reference gathers every sequence's K/V into a
padded copy and then reads it again. The C++ kernel reads each key/value row once, straight
from the block pool. It is compiled with torch's cpp_extension the first time it is needed
(~1 min, cached under the torch extensions directory); if the toolchain is missing or the
build fails, the engine logs why and keeps the torch reference.

The kernels take a layer's options (kernels/attention.py) themselves: a sliding `window`
bounds their loops (the keys behind it are never read, nor their block-table entries, which
a hybrid KV layout points at a reserved block of garbage) and `softcap` caps the scores
before the softmax. None (0 in C++) is a plain causal layer.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import structlog
import torch

from tokenloom.kernels.attention import decode_attention
from tokenloom.kernels.kv_quant import QuantizedCache

log = structlog.get_logger("tokenloom.kernels")
_SRC = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_lock = threading.Lock()
_module = None
_failed: str | None = None


def load_cpu_decode_kernel():
    """The compiled module, or None (with the reason logged once) if it cannot be built."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("TOKENLOOM_DISABLE_CPU_KERNEL"):
            _failed = "disabled by TOKENLOOM_DISABLE_CPU_KERNEL"
            return None
        try:
            from tokenloom.kernels.cpu.cpp_build import build

            _module = build("tokenloom_paged_decode_cpu", _SRC.name)
        except Exception as e:  # a missing compiler must not stop the engine
            _failed = f"{type(e).__name__}: {e}"
            log.warning("cpu decode kernel unavailable; using the torch reference", reason=_failed)
        return _module


def cpu_kernel_status() -> str:
    return "loaded" if _module is not None else (_failed or "not loaded")


def _options(window: int | None, softcap: float | None) -> tuple[int, float]:
    """A layer's options as the C++ kernels take them (0: none)."""
    assert window is None or window > 0, f"a sliding window of {window} keys"
    assert softcap is None or softcap > 0, f"a soft-cap of {softcap}"
    return (0 if window is None else int(window)), (0.0 if softcap is None else float(softcap))


def prefill_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                          window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """Causal attention of a prefill chunk over its context: q [n, H, D], k and v [KVH,
    ctx, D] -> [n, H, D] (query i at position ctx - n + i; with a `window`, it sees keys
    after ctx - n + i - window only). The C++ kernel: register-tiled scores and P . V, no
    mask tensor (paged_decode_cpu.cpp)."""
    return _module.prefill_attention(q, k, v, scale, *_options(window, softcap))


def prefill_attention_paged_cpu(q: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, block_table: torch.Tensor,
                                start_pos: int, scale: float, *, window: int | None = None,
                                softcap: float | None = None) -> torch.Tensor:
    """The same attention for a chunk at positions [start_pos, start_pos + n), its context
    read through `block_table` straight from the pool [blocks, BS, KVH, D]: no gathered
    copy of the context before the kernel repacks it (a continuation chunk's whole context
    was copied twice per layer)."""
    return _module.prefill_attention_paged(q, key_cache, value_cache, block_table, start_pos,
                                           scale, *_options(window, softcap))


def paged_decode_cpu(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     max_context: int = 0, scale: float = 1.0,
                     mask: torch.Tensor | None = None, *, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """q: [B, H, D] -> [B, H, D]; the same signature as attention.decode_attention
    (max_context and mask are not needed: the kernel stops at each context length and
    starts at each window's first key)."""
    options = _options(window, softcap)
    if isinstance(key_cache, QuantizedCache):
        if key_cache.promoted or value_cache.promoted:
            # A promoted layer reads its model-dtype copy (mixed K/V: the reference).
            if key_cache.promoted and value_cache.promoted:
                return _module.paged_decode(q, key_cache.full, value_cache.full, block_tables,
                                            context_lens, scale, *options)
            # (the step's mask has no window: the reference builds the layer's own)
            return decode_attention(q, key_cache, value_cache, block_tables, context_lens,
                                    max_context, scale, mask if window is None else None,
                                    window=window, softcap=softcap)
        return _module.paged_decode_q(q, key_cache.data, value_cache.data, key_cache.scale,
                                      value_cache.scale, key_cache.fmt.code,
                                      value_cache.fmt.code, block_tables, context_lens, scale,
                                      *options)
    return _module.paged_decode(q, key_cache, value_cache, block_tables, context_lens, scale,
                                *options)


# The layer options the kernels take (kernels/models/decoder.py, kernel_serves), and the
# paged form kernels.attention.prefill_attention calls for a chunk whose context is in a
# plain (unquantized) pool.
paged_decode_cpu.options = prefill_attention_cpu.options = ("window", "softcap")
prefill_attention_paged_cpu.options = ("window", "softcap")
prefill_attention_cpu.paged = prefill_attention_paged_cpu
