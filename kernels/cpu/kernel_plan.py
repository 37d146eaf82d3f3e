"""Which CPU kernel runs a projection at each batch size: measured at start-up on this
machine (`plan`), remembered per machine and model shape (`cached_plan`), as bands of rows
(`Plan`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tokenloom.kernels.cpu.kernel_set import (
    INT8,
    Q4,
    Q8,
    ROW_LADDER,
    KernelSet,
    block_gemm_module,
    has_int8_weight_op,
    small_gemm_module,
    tile_gemm_module,
)
from tokenloom.kernels.cpu.onednn import onednn_available
from tokenloom.startup_log import startup_log as log


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
               ("tokenloom_tile_gemm_cpu", "tile_gemm_cpu.cpp"))   # the projections


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


def band_kernel(bands: tuple[tuple[int, str], ...], rows: int) -> str:
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
