"""One projection's weight in the forms its CPU kernels need (`KernelSet`), the kernels'
names and storages, and the C++ kernel modules (built on first use).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.kernels.cpu import blocks as blk
from tokenloom.kernels.cpu.allocator import weight_arena
from tokenloom.kernels.cpu.onednn import ROWS_HINT, onednn_available, onednn_linear, onednn_pack
from tokenloom.startup_log import startup_log as log

# -- per-batch-size kernels, chosen by measuring -------------------------------------------
#
# A projection's weights can be multiplied by several kernels, each best at some batch size
# on some CPU: MKL (torch's default), oneDNN with a prepacked weight (above), the C++
# small-batch kernel (csrc/small_gemm_cpu.cpp: streams the weight once, fp32/bf16/int8
# storage, fp32 sums), torch's packed int8 matmul. `plan` times the candidates on one
# layer's projections at a ladder of row counts and keeps the fastest per band of rows;
# CpuLinear then dispatches each call on its row count. Measured, never assumed: which wins
# depends on the ISA, the caches and the core count.

ROW_LADDER = (1, 2, 4, 8, 16, 64, 256)
# kernels torch.compile cannot call (oneDNN's opaque packed weight; tile_gemm registers no
# shape function; tile_gemm_f32 and tile_gemm_int8 do, graphs/cpu_compile.py)
NOT_TRACEABLE = {"onednn", "copy_onednn", "tile_gemm", "copy_tile_bf16", "copy_fp32"}
HEAD_ROW_LADDER = (1, 4, 16, 64)
INT8 = "int8"
# Weights in GGUF-style 32-weight blocks (kernels/cpu/blocks.py): Q4_1 and Q8_0.
Q4, Q8 = "q4", "q8"
BLOCK_STORAGES = (Q4, Q8)
# Kernels that multiply by a dequantized copy of quantized weights (int8, q4, q8), kept once
# (never made per call): prefill-sized candidates, measured against the quantized kernels.
COPY_KERNELS = {"copy_mkl", "copy_onednn", "copy_tile_bf16", "copy_fp32"}

_small_gemm = None
_small_gemm_failed: str | None = None
_block_gemm = None
_block_gemm_failed: str | None = None
_tile_gemm = None
_tile_gemm_failed: str | None = None


def block_gemm_module():
    """The C++ block kernels for q4/q8 weights (built on first use), or None with the reason
    logged."""
    global _block_gemm, _block_gemm_failed
    if _block_gemm is None and _block_gemm_failed is None:
        try:
            from tokenloom.kernels.cpu.cpp_build import build
            _block_gemm = build("tokenloom_block_gemm_cpu", "block_gemm_cpu.cpp")
        except Exception as e:  # no compiler: q4/q8 fall back to a dequantized copy
            _block_gemm_failed = f"{type(e).__name__}: {e}"
            log.info("C++ block matmul unavailable", reason=_block_gemm_failed)
    return _block_gemm


def tile_gemm_module():
    """The C++ register-tiled kernels (csrc/tile_gemm_cpu.cpp; built on first use), or None:
    no compiler, or a CPU with neither AVX512-BF16 (vdpbf16ps) nor AVX2 + FMA."""
    global _tile_gemm, _tile_gemm_failed
    if _tile_gemm is None and _tile_gemm_failed is None:
        try:
            from tokenloom.kernels.cpu.cpp_build import build
            module = build("tokenloom_tile_gemm_cpu", "tile_gemm_cpu.cpp")
            if module.tile_gemm_built():
                _tile_gemm = module
            else:
                _tile_gemm_failed = "built without AVX512-BF16 or AVX2 + FMA"
        except Exception as e:  # no compiler: the other kernels still work
            _tile_gemm_failed = f"{type(e).__name__}: {e}"
            log.info("C++ tiled matmul unavailable", reason=_tile_gemm_failed)
    return _tile_gemm


def small_gemm_module():
    """The C++ small-batch kernel (built on first use), or None with the reason logged."""
    global _small_gemm, _small_gemm_failed
    if _small_gemm is None and _small_gemm_failed is None:
        try:
            from tokenloom.kernels.cpu.cpp_build import build
            _small_gemm = build("tokenloom_small_gemm_cpu", "small_gemm_cpu.cpp")
        except Exception as e:  # no compiler: the torch kernels still work
            _small_gemm_failed = f"{type(e).__name__}: {e}"
            log.info("C++ small-batch matmul unavailable", reason=_small_gemm_failed)
    return _small_gemm


def has_int8_weight_op() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: w [out, in] ~= q [out, in] * scale [out] (fp32)."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class KernelSet(nn.Module):
    """One projection's weight in the forms its kernels need, and the kernels by name.

    storage "float": the weight is kept in act_dtype (fp32 or bf16); "int8": per-channel
    int8 with fp32 scales, activations stay act_dtype; "q4" / "q8": 32-weight blocks
    (`blocks`: given, e.g. a GGUF file's own, or quantized here from `weight`). `only`:
    build just these (the rest would hold copies of the weight for nothing). The forms are
    buffers and `run` is plain code, so that a compiled region (graphs/cpu_compile.py)
    traced for one layer serves every layer: the layers differ only in their tensors."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, storage: str,
                 act_dtype: torch.dtype, only: set[str] | None = None,
                 blocks: "blk.Blocks | None" = None, excluded: frozenset = frozenset()):
        super().__init__()

        def want(name: str) -> bool:
            return (only is None or name in only) and name not in excluded

        names = []
        self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype),
                             persistent=False)
        self.register_buffer("empty", torch.empty(0), persistent=False)
        gemm = small_gemm_module()
        self.storage = storage
        self.grouped = False
        # The forms a decode step streams go to huge-page memory (allocator.py says why).
        place = weight_arena().place
        if storage in BLOCK_STORAGES:
            if blocks is None:
                blocks = (blk.quantize_q4 if storage == Q4 else blk.quantize_q8)(weight)
            # An AVX-512 VNNI build reads the codes in groups of 16 blocks (blocks.pack_groups;
            # the same bytes): `block_gemm` then runs the packed operators.
            self.grouped = block_gemm_module() is not None and block_gemm_module().packed_built()
            qs = blk.pack_groups(blocks.qs) if self.grouped else blocks.qs
            self.register_buffer("qs", place(qs), persistent=False)
            self.register_buffer("d", place(blocks.d), persistent=False)
            self.register_buffer("m", place(blocks.m) if storage == Q4 else None,
                                 persistent=False)
            if block_gemm_module() is not None and want("block_gemm"):
                names.append("block_gemm")
            names += self._copies(lambda: blk.dequantize(blocks), act_dtype, want)
            # The dequantized copy in bf16 on tile_gemm, for prefill-sized calls of an fp32
            # model: x and W rounded to bf16 (relative error 2^-9 each), products exact,
            # sums in fp32, the result not rounded; the block kernel rounds x to int8 blocks
            # (1/254 of each block's largest), so this adds no more error than the kernel it
            # stands in for. Never offered to a float model: fp32 there is exact.
            if (act_dtype == torch.float32 and want("copy_tile_bf16")
                    and blocks.d.shape[0] % 16 == 0 and tile_gemm_module() is not None):
                w16 = blk.dequantize(blocks).to(torch.bfloat16)
                self.register_buffer("tiles", place(tile_gemm_module().tile_gemm_pack(w16)),
                                     persistent=False)
                names.append("copy_tile_bf16")
        elif storage == INT8:
            q, scale = quantize_int8(weight)
            self.register_buffer("q", place(q), persistent=False)
            self.register_buffer("scale", scale, persistent=False)
            names += [n for n in ("small_gemm_int8", "small_gemm_strips_int8")
                      if gemm is not None and want(n)]
            # int8 panels of 16 outputs on the register-tiled kernel (tile_gemm_cpu.cpp)
            tiles = tile_gemm_module()
            if (q.shape[0] % 16 == 0 and want("tile_gemm_int8") and tiles is not None
                    and tiles.tile_gemm_int8_built()):
                self.register_buffer("tiles8", place(tiles.tile_gemm_int8_pack(q)),
                                     persistent=False)
                names.append("tile_gemm_int8")
            # torch's packed int8 matmul takes bf16 activations: a candidate only when the
            # model's activations are bf16 anyway. With fp32 activations it would round
            # them to bf16 whenever it measured fastest, so the numerics (and the quality
            # gate's verdict) would depend on a timing.
            if has_int8_weight_op() and want("int8pack_bf16") and act_dtype == torch.bfloat16:
                self.register_buffer("scale16", scale.to(torch.bfloat16), persistent=False)
                names.append("int8pack_bf16")
            names += self._copies(lambda: q.float() * scale[:, None], act_dtype, want)
            names += self._fp32_copy(lambda: q.float() * scale[:, None], act_dtype, want)
        else:
            self.register_buffer("w", place(weight.detach().to(act_dtype).contiguous()),
                                 persistent=False)
            if want("mkl"):
                names.append("mkl")
            if want("onednn"):
                packed = onednn_pack(self.w)
                if packed is not None:
                    self.register_buffer("packed", packed, persistent=False)
                    names.append("onednn")
            names += [n for n in ("small_gemm", "small_gemm_strips")
                      if gemm is not None and want(n)]
            # bf16 weight packed in panels of 16 outputs (tile_gemm_cpu.cpp: vdpbf16ps, or FMA)
            if (act_dtype == torch.bfloat16 and self.w.shape[0] % 16 == 0 and want("tile_gemm")
                    and tile_gemm_module() is not None):
                self.register_buffer("tiles", place(tile_gemm_module().tile_gemm_pack(self.w)),
                                     persistent=False)
                names.append("tile_gemm")
            # fp32 weight packed in panels of 16 outputs (tile_gemm_cpu.cpp, FMA)
            tiles = tile_gemm_module()
            if (act_dtype == torch.float32 and self.w.shape[0] % 16 == 0
                    and want("tile_gemm_f32") and tiles is not None
                    and tiles.tile_gemm_int8_built()):
                self.register_buffer("tiles32", place(tiles.tile_gemm_f32_pack(self.w)),
                                     persistent=False)
                names.append("tile_gemm_f32")
            names += self._fp32_copy(lambda: self.w.float(), act_dtype, want)
        self.names = tuple(names)

    def blocks(self) -> "blk.Blocks":
        """The q4 / q8 blocks as GGUF lays them out (the stored codes may be packed)."""
        qs = blk.unpack_groups(self.qs) if self.grouped else self.qs
        return blk.Q4Blocks(qs, self.d, self.m) if self.storage == Q4 else blk.Q8Blocks(qs, self.d)

    def _copies(self, dequantized, act_dtype: torch.dtype, want) -> list[str]:
        """A dequantized copy of a quantized weight, kept once (plain, and packed for oneDNN)
        for the prefill-sized calls where a dense matmul on it measures faster than the
        quantized kernel: never a dequantization per call."""
        if not (want("copy_mkl") or want("copy_onednn")):
            return []
        names = []
        self.register_buffer("w", dequantized().to(act_dtype).contiguous(), persistent=False)
        if want("copy_mkl"):
            names.append("copy_mkl")
        if want("copy_onednn"):
            packed = onednn_pack(self.w)
            if packed is not None:
                self.register_buffer("packed", packed, persistent=False)
                names.append("copy_onednn")
        if not want("copy_mkl"):
            self.w = None   # only the packed form is used
        return names

    def _fp32_copy(self, widened, act_dtype: torch.dtype, want) -> list[str]:
        """bf16 activations (a bf16 or int8 model): an fp32 copy of the weight, packed for
        oneDNN, for prefill-sized calls. On a CPU without bf16 dot instructions every bf16
        GEMM is emulated, and fp32's own GEMM measured 1.7x the best bf16 kernel at 64-256
        rows (a 2-core AVX2 machine). The numerics are no worse: bf16 x and W widen to
        fp32 exactly, the sums are fp32 as in every bf16 kernel here, the result is rounded
        to bf16 once (an int8 weight's copy is its dequantization in fp32, not rounded to
        bf16 as copy_mkl's is). 4 bytes a weight, kept only where the plan picks it and
        memory allows (LlamaModel._copy_kernels_excluded)."""
        if act_dtype != torch.bfloat16 or not want("copy_fp32") or not onednn_available():
            return []
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(widened().contiguous(), ROWS_HINT)
        except RuntimeError as e:
            log.info("oneDNN fp32 linear unavailable", reason=str(e))
            return []
        self.register_buffer("packed32", packed, persistent=False)
        self.register_buffer("bias32", None if self.bias is None else self.bias.float(),
                             persistent=False)
        return ["copy_fp32"]

    def run(self, name: str, x: torch.Tensor) -> torch.Tensor:
        b = self.bias
        if name == "copy_fp32":
            return onednn_linear(x.float(), self.packed32, self.bias32).to(x.dtype)
        if name == "block_gemm":
            bias = self.empty if b is None else b
            ops = torch.ops.tokenloom
            if self.storage == Q4:
                op = ops.q4_gemm_packed if self.grouped else ops.q4_gemm
                return op(x, self.qs, self.d, self.m, bias)
            op = ops.q8_gemm_packed if self.grouped else ops.q8_gemm
            return op(x, self.qs, self.d, bias)
        if name in ("mkl", "copy_mkl"):
            return F.linear(x, self.w, b)
        if name in ("onednn", "copy_onednn"):
            return onednn_linear(x, self.packed, b)
        if name in ("tile_gemm", "copy_tile_bf16"):   # fp32 x: rounded to bf16, fp32 out
            return torch.ops.tokenloom.tile_gemm(x, self.tiles, self.empty if b is None else b)
        if name == "tile_gemm_f32":
            return torch.ops.tokenloom.tile_gemm_f32(x, self.tiles32,
                                                     self.empty if b is None else b)
        if name == "tile_gemm_int8":
            return torch.ops.tokenloom.tile_gemm_int8(x, self.tiles8, self.scale,
                                                      self.empty if b is None else b)
        if name == "small_gemm_strips":
            return torch.ops.tokenloom.small_gemm_strips(x, self.w, self.empty,
                                                         self.empty if b is None else b)
        if name == "small_gemm_strips_int8":
            return torch.ops.tokenloom.small_gemm_strips(x, self.q, self.scale,
                                                         self.empty if b is None else b)
        if name == "small_gemm":
            return torch.ops.tokenloom.small_gemm(x, self.w, self.empty,
                                                  self.empty if b is None else b)
        if name == "small_gemm_int8":
            return torch.ops.tokenloom.small_gemm(x, self.q, self.scale,
                                                  self.empty if b is None else b)
        if name == "int8pack_bf16":   # its fp32-activation path is scalar; bf16 is vectorised
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q,
                                                   self.scale16).to(x.dtype)
            return y if b is None else y + b
        raise ValueError(f"unknown CPU matmul kernel {name!r}")
