"""Where and how the model runs: device, dtype and the decode-attention backend.

One place decides these, from the config and what the machine offers; each choice that
falls back says why (a missing kernel, no CUDA device...) on the "tokenloom.startup" logger.
"""

from __future__ import annotations

import os

import torch

from tokenloom.config.schema import ConfigError
from tokenloom.kernels.models.loader import DTYPES
from tokenloom.startup_log import startup_log


def pick_device(name: str) -> torch.device:
    """The device for `model.device`. "cuda:N" also makes GPU N the process's current CUDA
    device, so that everything allocated or captured without an explicit device (streams,
    events, graph pools, Triton launches) lands on it too."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"config error: model.device is {name!r} but no CUDA device is "
                              f"available", key="model.device")
        device = torch.device(name)
        if device.index is not None:
            count = torch.cuda.device_count()
            if device.index >= count:
                raise ConfigError(f"config error: model.device {name!r}: this host has {count} "
                                  f"CUDA device(s), cuda:0..cuda:{count - 1}",
                                  key="model.device")
            torch.cuda.set_device(device)
        return device
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "float16" and device.type == "cpu":
        raise ConfigError("config error: model.dtype float16 is not supported on CPU "
                          "(allowed on CPU: float32, bfloat16)")
    return DTYPES[name]


def select_decode_backend(model, wanted: str, device: torch.device,
                          max_model_len: int = 0, block_size: int = 16,
                          kv_quantized: bool = False) -> str:
    """Pick the decode-attention implementation; falls back to the torch reference with a
    stated reason when the wanted kernel is unavailable."""
    if device.type == "cuda":
        return _select_cuda_backend(model, wanted, max_model_len, block_size, kv_quantized)
    if wanted == "triton":
        raise ConfigError("model.attention_backend 'triton' needs model.device cuda "
                          "(on CPU: auto, torch or cpu_kernel)", key="model.attention_backend")
    if device.type == "cpu":
        log_cpu_features(model.embed_tokens.weight.dtype)
        from tokenloom.kernels.cpu.allocator import keep_freed_memory
        if keep_freed_memory():   # no page faults on a step's temporaries (allocator.py)
            startup_log.info("CPU allocator: freed memory kept in the process (glibc mallopt)")
    if wanted == "torch" or (wanted == "auto" and device.type != "cpu"):
        return "torch"
    if device.type == "cpu":
        from tokenloom.kernels.cpu import layer_ops
        from tokenloom.kernels.cpu.cpp_build import prebuild
        if not os.environ.get("TOKENLOOM_DISABLE_CPU_KERNEL"):
            prebuild()   # a fresh machine's kernels, in parallel (one compiler process each)
        if layer_ops.install(model):   # residual add + RMSNorm and SiLU*mul in C++
            startup_log.info("CPU layer ops: C++ residual add + RMSNorm and SiLU*mul")
    if device.type != "cpu":
        raise ConfigError("config error: model.attention_backend 'cpu_kernel' needs "
                          "model.device cpu")
    from tokenloom.kernels.cpu.attention import (
        cpu_kernel_status,
        load_cpu_decode_kernel,
        paged_decode_cpu,
        prefill_attention_cpu,
    )
    if load_cpu_decode_kernel() is None:
        reason = cpu_kernel_status()
        startup_log.info(f"decode attention: torch reference (C++ kernel unavailable: {reason})",
                         backend="torch", reason=reason)
        return "torch"
    model.set_decode_kernel(paged_decode_cpu)
    if model.embed_tokens.weight.dtype in (torch.float32, torch.bfloat16):
        model.set_prefill_kernel(prefill_attention_cpu)
    from tokenloom.kernels.cpu import decode_stack
    if decode_stack.install(model):   # fp32: a decode step's layers in one C++ call
        startup_log.info("CPU decode steps: the decoder layers in one C++ call")
    return "cpu_kernel"


def log_cpu_features(dtype: torch.dtype) -> None:
    """Say what this CPU offers and what that means for the chosen dtype (the kernels per
    batch size are logged when they are measured, at the first forward)."""
    from tokenloom.kernels.cpu.features import detect

    f = detect()
    startup_log.info(f"CPU: {f.model_name or 'unknown model'}, {f.summary()}",
                     cpu=f.model_name, features=sorted(f.flags),
                     torch_capability=f.torch_capability)
    if dtype == torch.bfloat16 and not f.bf16:
        startup_log.warning("model.dtype bfloat16 on a CPU without bf16 instructions "
                            "(AVX512-BF16 or AMX): bf16 arithmetic is emulated here; float32 "
                            "may be faster", features=f.summary())


def _select_cuda_backend(model, wanted: str, max_model_len: int, block_size: int,
                         kv_quantized: bool = False) -> str:
    """On CUDA: Triton kernels (paged decode attention for auto/triton; the graph-safe KV
    store and the fused RMSNorm, SiLU*mul and RoPE+store always) when every one of them
    passes a smoke test in the model's dtype and shapes; otherwise the torch reference for
    all of them, graphs and eager alike, with the reason logged."""
    if wanted == "cpu_kernel":
        raise ConfigError("model.attention_backend 'cpu_kernel' needs model.device cpu",
                          key="model.attention_backend")
    spec = model.spec
    head_dim = spec.head_dim
    reason = None
    try:
        from tokenloom.kernels.gpu import triton_fused
        from tokenloom.kernels.gpu.triton_attention import make_decode_kernel, store_kv_triton
    except Exception as e:  # triton missing or broken: the reference still works
        reason = f"{type(e).__name__}: {e}"
    if reason is None and torch.cuda.is_available():
        reason = triton_fused.smoke_test(
            "cuda", model.embed_tokens.weight.dtype, num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, head_dim=head_dim, hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size, block_size=block_size,
            partition=64)   # the smallest partition: two of them and the reduce
    if reason is not None:
        startup_log.warning(f"Triton kernels off ({reason}); attention, KV store and layer ops "
                            "run the torch reference", backend="torch", reason=reason)
        return "torch"
    pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if kv_quantized:
        # A quantized cache is written by its own graph-safe store (scales grow per block);
        # the fused RoPE+store writes model-dtype rows, so RoPE runs unfused.
        from tokenloom.kernels.gpu.triton_attention import store_kv_quant_triton
        model.set_kv_store_kernel(store_kv_quant_triton)
    else:
        model.set_kv_store_kernel(store_kv_triton)
    model.set_fused_kernels(triton_fused.rms_norm_triton, triton_fused.silu_mul_triton,
                            triton_fused.rope_store_triton if pow2 and not kv_quantized
                            else None)
    if wanted == "torch":
        return "torch"
    if not pow2:
        reason = f"head dim {head_dim} is not a power of two >= 16"
        startup_log.info(f"decode attention: torch reference (Triton kernel unavailable: "
                         f"{reason})", backend="torch", reason=reason)
        return "torch"
    # Partitions sized per step from the batch and the SM count (kernels/gpu/decode_split.py).
    model.set_decode_kernel(make_decode_kernel(spec))
    return "triton"
