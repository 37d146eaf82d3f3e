"""fp32 projections on CPU through oneDNN with prepacked weights, when it measures faster.

torch's default CPU matmul (MKL) streams a decode batch's weights at a fraction of the
memory bandwidth; oneDNN's inner-product primitive on a weight reordered once into its
blocked layout (`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, the
path torch's own CPU inductor uses) streams them far better. Measured on a 2-core AVX2
machine, SmolLM2-135M's 30 layers of projections: 20 -> 12 ms at 1 row, 32 -> 11 ms at
4, 41 -> 15 ms at 16, 44 -> 18 ms for a 256-token chunk of one gate_up projection x10;
the 49k-vocabulary head 6.8 -> 2.7 ms at 1 row.

Which is faster depends on the CPU (ISA, caches, core count), so the choice is made by
measuring on this machine at start-up (`choose`), never by a constant. Results differ from
MKL's only in the rounding of the sums (as they do between batch sizes).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.arith import cdiv
from tokenloom.kernels.cpu import blocks as blk
from tokenloom.kernels.cpu.allocator import weight_arena
from tokenloom.startup_log import startup_log as log

ROWS_HINT = 16   # the batch size oneDNN picks the packed layout for (any size works)


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# dtypes whose oneDNN reorder this torch refused (a CPU without the primitive, e.g. bf16 on
# AVX2): not tried again, so the reason is logged once, not once per projection and plan
# trial (a six-model benchmark printed it ~200 times).
_ONEDNN_REFUSED: set[torch.dtype] = set()


def _onednn_pack(w: torch.Tensor) -> torch.Tensor | None:
    """w reordered for oneDNN's linear, or None where this torch or CPU cannot."""
    if not onednn_available() or w.dtype in _ONEDNN_REFUSED:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
    except RuntimeError as e:  # a torch build without the primitive for this dtype
        _ONEDNN_REFUSED.add(w.dtype)
        log.info("oneDNN linear unavailable", dtype=str(w.dtype), reason=str(e))
        return None


class PackedLinear(nn.Module):
    """A Linear whose weight is reordered once for oneDNN (CPU, fp32). Same contract as
    nn.Linear for 2-D inputs [rows, in_features] -> [rows, out_features]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)


# oneDNN builds (JIT-compiles) a primitive for every input shape it sees and keeps it in its
# process-wide primitive cache (1,024 entries): 0.3-0.6 MiB of native memory each (measured
# on the tiny test model's shapes and SmolLM2's: benchmarks/onednn_shapes.py). A server's
# steps have every row count from 1 to the batch-token budget, so keyed by the exact count
# the cache grew by ~0.8 KiB a request under mixed traffic (the soak: ~9 MiB a minute,
# until the cache is full at 0.3-0.6 GiB). Calls are therefore made at a bounded set of row
# counts: exact up to ONEDNN_EXACT_ROWS (decode batches, where the weights' memory traffic
# dominates), above it rounded up to 1/8 of the power of two below (at most 12.5% padding
# rows, 8 shapes per doubling: 72 up to 2,048 rows).
ONEDNN_EXACT_ROWS = 16


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN call for `rows` rows is made at (>= rows)."""
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 4)
    return cdiv(rows, step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x . W^T + b through oneDNN's packed weight, at a padded row count (onednn_rows)."""
    rows = x.shape[0]
    padded = onednn_rows(rows)
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if padded == rows else out[:rows]


def _median_ms(fn, reps: int = 5) -> float:
    fn()  # warm-up (first call allocates)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def choose(linears: list[nn.Linear], rows: tuple[int, ...] = (1, 16, 128)) -> bool:
    """Whether oneDNN with packed weights beats the current layout on these projections
    (e.g. one decoder layer's), summed over decode- and prefill-sized batches."""
    if not onednn_available() or not linears:
        return False
    try:
        packed = [PackedLinear(lin) for lin in linears]
    except RuntimeError as e:  # a torch build without the primitive
        log.info("oneDNN linear unavailable; using MKL", reason=str(e))
        return False
    with torch.inference_mode():
        mkl = onednn = 0.0
        for n in rows:
            xs = [torch.randn(n, lin.in_features) for lin in linears]
            mkl += _median_ms(lambda: [lin(x) for lin, x in zip(linears, xs)])
            onednn += _median_ms(lambda: [p(x) for p, x in zip(packed, xs)])
    use = onednn < mkl
    log.info(f"CPU projections: {'oneDNN packed' if use else 'MKL'} (measured {onednn:.2f} ms "
             f"oneDNN vs {mkl:.2f} ms MKL for one layer at {', '.join(map(str, rows))} rows)",
             onednn_ms=round(onednn, 3), mkl_ms=round(mkl, 3))
    return use


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
                packed = _onednn_pack(self.w)
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
            packed = _onednn_pack(self.w)
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


def _min_ms(fn, reps: int = 5, before=None) -> float:
    """Best of `reps` (the machine may be shared: the minimum is the kernel's own time).
    `before`: called (untimed) before each run."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


@dataclasses.dataclass(frozen=True)
class Plan:
    """Kernel per band of rows: bands[i] = (max_rows, name); the last band takes the rest."""
    bands: tuple[tuple[int, str], ...]
    timings: dict            # rows -> {kernel: ms}

    def describe(self) -> str:
        parts, lo = [], 1
        for i, (hi, name) in enumerate(self.bands):
            last = i == len(self.bands) - 1
            parts.append(f"{lo}+ rows {name}" if last else
                         (f"{lo} row {name}" if lo == hi else f"{lo}-{hi} rows {name}"))
            lo = hi + 1
        return ", ".join(parts)

    @property
    def kernels(self) -> set[str]:
        return {name for _, name in self.bands}

    def excluding(self, names: set[str]) -> "Plan":
        """The same measurements without these kernels: the fastest of the rest per row
        count (e.g. for a compiled program, which cannot call oneDNN's packed weights)."""
        if not names & self.kernels:
            return self
        best = []
        for n, times in sorted(self.timings.items()):
            allowed = {k: v for k, v in times.items() if k not in names}
            best.append((n, min(allowed, key=allowed.get) if allowed else "mkl"))
        if not best:
            best = [(1, "mkl")]
        return Plan(_merge_bands(best), self.timings)


def _available(name: str) -> bool:
    """Whether kernel `name` can run in this process (a remembered plan may name one that
    cannot any more, e.g. the C++ build failed this time)."""
    if name.startswith("small_gemm"):
        return small_gemm_module() is not None
    if name == "block_gemm":
        return block_gemm_module() is not None
    if name in ("onednn", "copy_onednn", "copy_fp32"):
        return onednn_available()
    if name == "int8pack_bf16":
        return has_int8_weight_op()
    if name in ("tile_gemm", "copy_tile_bf16"):
        return tile_gemm_module() is not None
    if name in ("tile_gemm_int8", "tile_gemm_f32"):
        return tile_gemm_module() is not None and tile_gemm_module().tile_gemm_int8_built()
    return name in ("mkl", "copy_mkl")


# Bumped when the set of candidate kernels changes (a plan remembered before would never
# consider the new ones): 2 = small_gemm walks rows, small_gemm_strips added; 3 = tile_gemm
# added; 4 = copy_tile_bf16 added (q4/q8 with fp32 activations); 5 = copy_fp32 added (bf16
# activations). A change to a C++ kernel's source needs no bump: its build digest is part
# of the key.
PLAN_VERSION = "kernels-6"
CPP_KERNELS = (("tokenloom_small_gemm_cpu", "small_gemm_cpu.cpp"),
               ("tokenloom_block_gemm_cpu", "block_gemm_cpu.cpp"),
               ("tokenloom_tile_gemm_cpu", "tile_gemm_cpu.cpp"))


def plan_cache_key(weights: list[tuple[torch.Tensor, torch.Tensor | None]], storage: str,
                   act_dtype: torch.dtype, rows: tuple[int, ...],
                   excluded: frozenset = frozenset(), from_memory: bool = False) -> str:
    """What a measured plan depends on: the projections' shapes and dtypes, the storage,
    the row ladder, this CPU, torch, the thread count, whether it was timed from memory
    and the C++ kernels' sources (a faster kernel must be measured again)."""
    import hashlib

    from tokenloom.kernels.cpu.cpp_build import build_name
    from tokenloom.kernels.cpu.features import detect

    parts = [PLAN_VERSION, storage, str(act_dtype), repr(rows), detect().summary(),
             torch.__version__,
             str(torch.get_num_threads()), repr(sorted(excluded)), f"memory={from_memory}"]
    parts += [build_name(base, source) for base, source in CPP_KERNELS]
    parts += [f"{tuple(w.shape)}:{w.dtype}:{b is not None}" for w, b in weights]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cached_plan(weights: list[tuple[torch.Tensor, torch.Tensor | None]], storage: str,
                act_dtype: torch.dtype, rows: tuple[int, ...] = ROW_LADDER,
                cache_dir=None, blocks: list | None = None,
                excluded: frozenset = frozenset(), from_memory: bool = False) -> Plan:
    """`plan`, remembered in `cache_dir` (when given) for the next start on this machine:
    the choice stays the same from one start to the next (measurements are noisy), so the
    compiled decode programs that call the chosen kernels stay in their on-disk cache."""
    import json
    from pathlib import Path

    path = None
    if cache_dir is not None:
        key = plan_cache_key(weights, storage, act_dtype, rows, excluded, from_memory)
        path = Path(cache_dir) / "cpu_kernel_plans" / f"{key}.json"
        try:
            raw = json.loads(path.read_text())
            cached = Plan(tuple((int(hi), str(name)) for hi, name in raw["bands"]),
                          {int(n): {str(k): float(v) for k, v in t.items()}
                           for n, t in raw["timings"].items()})
            if all(_available(name) for name in cached.kernels):
                return cached
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    chosen = plan(weights, storage, act_dtype, rows, blocks, excluded, from_memory)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"bands": chosen.bands, "timings": chosen.timings}))
        except OSError as e:
            log.info("could not remember the CPU kernel plan", path=str(path), reason=str(e))
    return chosen


def plan(weights: list[tuple[torch.Tensor, torch.Tensor | None]], storage: str,
         act_dtype: torch.dtype, rows: tuple[int, ...] = ROW_LADDER,
         blocks: list | None = None, excluded: frozenset = frozenset(),
         from_memory: bool = False) -> Plan:
    """Time every candidate kernel on these projections (e.g. one decoder layer's) at each
    row count and keep the fastest per row count, merged into bands. `blocks`: the
    projections' own q4/q8 blocks (aligned with `weights`); `excluded`: kernels not to
    consider (e.g. the dequantized copies where memory does not allow them);
    `from_memory`: the model's weights outgrow the last-level cache (see below)."""
    blocks = blocks or [None] * len(weights)
    cands = [KernelSet(w, b, storage, act_dtype, blocks=bl, excluded=excluded)
             for (w, b), bl in zip(weights, blocks)]
    names = [n for n in cands[0].names if all(n in c.names for c in cands)]
    if not names and excluded:   # no quantized kernel built here: a copy is all there is
        return plan(weights, storage, act_dtype, rows, blocks, from_memory=from_memory)
    # A decode step of a model larger than the last-level cache streams every layer's
    # weights from memory; one layer's alone would stay in the cache between timing runs,
    # and the kernel that is fastest from the cache need not be fastest from memory (on one
    # AMD Zen 4, small_gemm's two ways of walking the weights swapped places). For such a
    # model decode-sized calls are timed from memory: the cache is flushed (a buffer twice
    # its size is read) before each timed run. A model that fits runs from the cache.
    flush = _cache_flusher() if from_memory else None
    timings: dict[int, dict[str, float]] = {}
    best: list[str] = []
    with torch.inference_mode():
        for n in rows:
            xs = [torch.randn(n, w.shape[1]).to(act_dtype) for w, _ in weights]
            before = flush if n <= STREAMING_ROWS else None   # None: no flush
            timings[n] = {name: _min_ms(lambda: [c.run(name, x) for c, x in zip(cands, xs)],
                                        before=before)
                          for name in names}
            best.append(min(timings[n], key=timings[n].get))
    return Plan(_merge_bands(list(zip(rows, best))), timings)


# Row counts up to this are weight-streaming (timed from memory, not cache, by `plan`).
STREAMING_ROWS = 16


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (0 when unknown)."""
    from pathlib import Path

    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        try:
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best


def weight_bytes_per_element(storage: str, act_dtype: torch.dtype) -> float:
    """What a decode kernel streams per weight in `storage` (scales included)."""
    return {Q4: 0.625, Q8: 1.0625, INT8: 1.0}.get(
        storage, torch.tensor([], dtype=act_dtype).element_size())


def _cache_flusher():
    """A function that evicts the caches: it reads a buffer twice the last-level cache's
    size (at least 64 MiB)."""
    buf = torch.ones(max(2 * last_level_cache_bytes(), 64 << 20) // 4)
    return lambda: buf.sum()


def _band_kernel(bands: tuple[tuple[int, str], ...], rows: int) -> str:
    for hi, name in bands:
        if rows <= hi:
            return name
    return bands[-1][1]


def _merge_bands(best: list[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """(rows, kernel) per measured row count -> bands of consecutive equal kernels."""
    bands: list[tuple[int, str]] = []
    for n, name in best:
        if bands and bands[-1][1] == name:
            bands[-1] = (n, name)
        else:
            bands.append((n, name))
    return tuple(bands)


class CpuLinear(nn.Module):
    """A projection whose kernel depends on the call's row count (a measured Plan). Same
    contract as nn.Linear for 2-D inputs [rows, in_features] -> [rows, out_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, storage: str,
                 act_dtype: torch.dtype, chosen: Plan, blocks: "blk.Blocks | None" = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.storage = storage
        # What a decode call streams: the weight once (int8: plus its fp32 scales; q4/q8:
        # the blocks with their fp16 scales and mins).
        element = 1 if storage == INT8 else torch.tensor([], dtype=act_dtype).element_size()
        self.weight_bytes = (self.out_features * self.in_features * element
                             + (4 * self.out_features if storage == INT8 else 0))
        # Compiled decode programs (graphs/cpu_compile.py) cannot call oneDNN's packed
        # weights: while tracing, the fastest other kernel for the row count is used.
        traced = chosen.excluding(NOT_TRACEABLE)
        self.kernels = KernelSet(weight, bias, storage, act_dtype,
                                 chosen.kernels | traced.kernels, blocks=blocks)
        if storage in BLOCK_STORAGES:
            self.weight_bytes = sum(t.numel() * t.element_size()
                                    for t in (self.kernels.qs, self.kernels.d, self.kernels.m)
                                    if t is not None)
        self._bands = chosen.bands
        self._traced_bands = traced.bands
        self.kernel_names = tuple(name for _, name in chosen.bands)
        self.traced_kernel_names = tuple(name for _, name in traced.bands)

    def kernel_for(self, rows: int) -> str:
        """The kernel an eager call with `rows` rows runs."""
        return _band_kernel(self._bands, rows)

    def traced_kernel_for(self, rows: int) -> str:
        """The kernel a compiled program with `rows` rows runs."""
        return _band_kernel(self._traced_bands, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        bands = self._traced_bands if torch.compiler.is_compiling() else self._bands
        for hi, name in bands:
            if rows <= hi:
                return self.kernels.run(name, x)
        return self.kernels.run(bands[-1][1], x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"storage={self.storage}, kernels={self.kernel_names}")
