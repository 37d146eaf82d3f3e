"""Capture decode CUDA graphs at start-up, and replay them.

Capture order is largest bucket first, every graph sharing one memory pool: the largest
graph's intermediates are a superset of every smaller one's, so the pool is sized once and
later graphs reuse it. Each bucket is warmed up eagerly over the static buffers before it is
captured (kernels are compiled/autotuned and lazy allocations made outside the graph).
The Python garbage collector is frozen during capture (a collection mid-capture can free
tensors whose memory the graph would then reuse). Time and memory are logged, memory is
checked against the configured budget, and capture is closed afterwards: any later attempt
raises `CaptureClosedError` instead of silently capturing work into a new graph.

Everything but `torch.cuda.graph` itself runs on CPU too: `DecodeGraphs.forward_static`
runs the same padded static-buffer forward eagerly, which is how the CPU tests check
padding, skipped KV slots and buffer filling through the real model.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import TYPE_CHECKING

import torch

from tokenloom.graphs.buffers import DecodeBuffers
from tokenloom.kernels.kv_store import KVCache

if TYPE_CHECKING:
    from tokenloom.actors.messages import ScheduledSequence

try:
    from tokenloom.startup_log import startup_log
except ImportError:  # the GPU check runs with nothing but torch + triton
    startup_log = None


class CaptureError(RuntimeError):
    """Capture failed or did not fit its budget; the engine falls back to eager."""


class CaptureClosedError(RuntimeError):
    """A capture was attempted after start-up capture was closed."""


_capture_open = False


@contextlib.contextmanager
def capture_window():
    """The only window in which `DecodeGraphs.capture_one` may run."""
    global _capture_open
    _capture_open = True
    try:
        yield
    finally:
        _capture_open = False


def capture_allowed() -> bool:
    return _capture_open


class DecodeGraphs:
    """One CUDA graph per bucket over shared static buffers (see graphs/buffers.py)."""

    def __init__(self, model, kv: KVCache, buffers: DecodeBuffers):
        self.model = model
        self.kv = kv
        self.buffers = buffers
        self.graphs: dict[int, "torch.cuda.CUDAGraph"] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        # Counted where they happen: a captured graph replayed, or a bucket without a
        # graph run through the static-buffer forward instead.
        self.num_replays = 0
        self.num_static_eager = 0

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    # -- the static-buffer forward (captured on CUDA; run eagerly on CPU and for warm-up) --
    def forward_static(self, size: int) -> torch.Tensor:
        """Forward the first `size` static rows; logits land in buffers.logits[:size]."""
        b = self.buffers
        out = self.model(b.input_ids[:size], b.positions[:size], self.kv, b.meta(size),
                         b.logits_indices[:size])
        b.logits[:size].copy_(out)
        return b.logits[:size]

    def run(self, seqs: list[ScheduledSequence], padded: int, patch=None) -> torch.Tensor:
        """Fill the buffers, replay the bucket's graph (or run it eagerly when none was
        captured, e.g. on CPU); returns logits [padded, vocab] (a view: copy to keep).
        `patch`: None, or (rows, token ids on the device) written into the input ids after
        the fill — the previous step's samples, without a round trip through the host."""
        self.buffers.fill(seqs, padded)
        if patch is not None:
            self.buffers.input_ids.index_copy_(0, patch[0], patch[1])
        graph = self.graphs.get(padded)
        if graph is None:
            self.num_static_eager += 1
            return self.forward_static(padded)
        graph.replay()
        self.num_replays += 1
        return self.buffers.logits[:padded]

    def replay_each(self) -> None:
        """Replay every captured graph once over padding rows (no KV written) before the
        server is ready, so a graph that cannot replay, or replays to non-finite logits,
        fails start-up's capture instead of a request."""
        b = self.buffers
        b.slot_mapping.fill_(-1)
        b.context_lens.fill_(1)
        for size, graph in sorted(self.graphs.items()):
            graph.replay()
            if not bool(torch.isfinite(b.logits[:size]).all()):
                raise RuntimeError(f"the graph for batch {size} replayed to non-finite logits")
        torch.cuda.synchronize()

    # -- capture ---------------------------------------------------------------------------
    def capture_one(self, size: int, warmup: int = 2) -> None:
        if not capture_allowed():
            raise CaptureClosedError(
                f"CUDA graph capture for batch {size} attempted after start-up capture closed")
        b = self.buffers
        # Padding rows only: warm-up and capture write no KV (slot -1) and read block 0.
        b.slot_mapping[:size].fill_(-1)
        b.context_lens[:size].fill_(1)
        # The warm-up runs eagerly (the eager split); compile the graph's own decode-attention
        # variant outside the capture too (kernels/triton_attention.SplitDecode).
        prepare = getattr(self.model.layers[0].self_attn.decode_fn, "prepare_capture", None)
        if prepare is not None:
            prepare(size, b.max_context, self.kv)
        with torch.inference_mode():
            for _ in range(warmup):
                self.forward_static(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.forward_static(size)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[size] = graph

    def capture(self, sizes: tuple[int, ...], memory_budget_bytes: int,
                progress: bool = True) -> None:
        """Capture every size, largest first; raise CaptureError (graphs dropped) on failure
        or when the graphs take more than `memory_budget_bytes` of device memory."""
        if not torch.cuda.is_available() or self.buffers.device.type != "cuda":
            raise CaptureError("CUDA graphs need a CUDA device")
        assert max(sizes) <= self.buffers.max_size, "buffers are smaller than the largest bucket"
        self.capture_seconds, self.capture_bytes = capture_buckets(
            sizes, self.capture_one, self.replay_each, self.drop, progress=progress,
            label="decode buckets", unit="graph", postfix="batch",
            budget=memory_budget_bytes, budget_name="the budget")

    def drop(self) -> None:
        self.graphs.clear()
        self.pool = None


def capture_buckets(sizes, capture_one, replay_each, drop, *, progress: bool, label: str,
                    unit: str, postfix: str, budget: int, budget_name: str) -> tuple[float, int]:
    """Start-up capture, shared by decode and piecewise graphs: `capture_one(size)` for every
    size, largest first, inside the capture window, with the garbage collector frozen (a
    collection mid-capture can free tensors whose memory a graph then reuses) and a progress
    bar; then `replay_each()`. Logs time and memory. On failure, or over `budget` bytes of
    device memory, calls `drop()` and raises CaptureError. Returns (seconds, bytes)."""
    order = sorted(sizes, reverse=True)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(order), desc=f"capturing {label}", unit=unit, leave=False)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()
    try:
        with capture_window():
            for size in order:
                capture_one(size)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix({postfix: size})
        replay_each()
    except CaptureClosedError:
        raise
    except Exception as e:
        drop()
        raise CaptureError(f"{label} capture failed: {type(e).__name__}: {e}") from e
    finally:
        gc.unfreeze()
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    used = max(0, free_before - torch.cuda.mem_get_info()[0])
    if startup_log is not None:
        startup_log.info(f"CUDA graphs: {len(order)} {label} ({order[-1]}..{order[0]}) captured "
                         f"in {seconds:.1f}s using {used / 2**20:.0f} MiB", sizes=sorted(sizes),
                         seconds=round(seconds, 2), memory_mib=round(used / 2**20, 1))
    if used > budget:
        drop()
        torch.cuda.empty_cache()
        raise CaptureError(f"{label} took {used / 2**20:.0f} MiB, over {budget_name} of "
                           f"{budget / 2**20:.0f} MiB (graphs.memory_budget_bytes)")
    return seconds, used
