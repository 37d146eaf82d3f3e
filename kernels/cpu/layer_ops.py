"""The CPU decode step's small per-layer ops in C++ (csrc/layer_ops_cpu.cpp): residual add +
RMSNorm and SiLU(gate) * up, each one pass over the row instead of torch's chain of ops.
Installed through CausalLM.set_fused_kernels with the same contracts as the GPU's
Triton kernels; fp32 and bf16 (bf16 rounds where the torch reference does; compiled programs
use the torch reference)."""

from __future__ import annotations

import torch

from tokenloom.kernels.models.layers import silu_and_mul
from tokenloom.startup_log import startup_log as log

_module = None
_failed: str | None = None


def module():
    """The built extension, or None with the reason logged (no compiler)."""
    global _module, _failed
    if _module is None and _failed is None:
        try:
            from tokenloom.kernels.cpu.cpp_build import build
            _module = build("tokenloom_layer_ops_cpu", "layer_ops_cpu.cpp")
        except Exception as e:
            _failed = f"{type(e).__name__}: {e}"
            log.info("C++ layer ops unavailable; torch reference", reason=_failed)
    return _module


DTYPES = (torch.float32, torch.bfloat16)


def _eager(x: torch.Tensor) -> bool:
    return x.dtype in DTYPES and not torch.compiler.is_compiling()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """norm(residual + x) with residual updated in place (when given), else norm(x)."""
    if (_eager(x) and weight.dtype == x.dtype and x.is_contiguous()
            and (residual is None or residual.is_contiguous())):
        return _module.rms_norm(x, weight, eps, residual)
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    if _eager(gate_up) and gate_up.dim() == 2 and gate_up.is_contiguous():
        return _module.silu_mul(gate_up)
    return silu_and_mul(gate_up)


def install(model) -> bool:
    """Route the model's norms and SiLU*mul through the C++ ops (fp32 and bf16 models on
    CPU)."""
    if model.embed_tokens.weight.dtype not in DTYPES or module() is None:
        return False
    model.set_fused_kernels(rms_norm_cpu, silu_mul_cpu, None)
    return True
