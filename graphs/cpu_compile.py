"""Compiled static-shape decode programs on CPU: what CUDA graphs are on a GPU.

An eager decode step on CPU pays Python and operator-dispatch overhead for every small op
of every layer (~20 ops a layer, 30 layers), which at batch 1 is a large share of a step
whose real work is streaming the weights once. Here each decode bucket (graphs/buckets.py,
the same buckets and dispatcher as CUDA graphs) gets a program compiled by torch.compile
(Inductor) over the same static buffers CUDA graphs read (graphs/buffers.py): the
RMSNorm + residual, RoPE and SiLU*mul chains each become one generated C++ loop, and the
projections, the KV store and the decode attention are called directly, with the kernel
the per-batch-size plan chose (kernels/cpu/kernel_plan.py) for that bucket.

- Compiled at start-up, largest bucket first, with a progress bar; a bucket that fails to
  compile is dropped with the reason logged and its batches run eager.
- Cached on disk: Inductor's FX-graph and AOT caches live under
  `<cache_dir>/cpu_programs/<key>`, key = digest of the model's shape, dtype, torch
  version, CPU features and the chosen kernels. A warm start only re-traces (seconds).
- After start-up no program is ever compiled again: a step that would need a recompile
  (it cannot, with the same shapes; this is the guard) runs eager and the reason is
  counted, instead of stalling the server for a minute on live traffic.

The decode attention must be the C++ kernel (a dispatcher op the program can call; the
torch reference gathers a context-sized copy that a static program would size for the
longest context).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from tokenloom.graphs.buffers import DecodeBuffers
from tokenloom.kernels.kv_store import KVCache
from tokenloom.startup_log import startup_log

if TYPE_CHECKING:
    from tokenloom.actors.messages import ScheduledSequence

log = structlog.get_logger("tokenloom.graphs")

_fakes_registered: set[str] = set()
_engine_ids = itertools.count()


def register_shape_functions() -> None:
    """Tell the compiler the output shapes of the C++ ops (kernels/cpu/csrc): it traces with
    fake tensors and never runs them. Needs the kernels loaded (they define the ops); an op
    loaded later is registered at the next call."""
    def register(name: str, fn) -> None:
        if name not in _fakes_registered and hasattr(torch.ops.tokenloom, name):
            torch.library.register_fake(f"tokenloom::{name}")(fn)
            _fakes_registered.add(name)

    register("paged_decode_cpu", lambda q, key_cache, value_cache, block_tables, context_lens,
             scale: torch.empty_like(q, memory_format=torch.contiguous_format))
    register("paged_decode_window_cpu",
             lambda q, key_cache, value_cache, block_tables, context_lens, scale, window,
             softcap: torch.empty_like(q, memory_format=torch.contiguous_format))
    register("store_kv_cpu", lambda key, value, key_cache, value_cache, slots: None)
    register("small_gemm", lambda x, w, scale, bias: x.new_empty((x.shape[0], w.shape[0])))
    register("small_gemm_strips",
             lambda x, w, scale, bias: x.new_empty((x.shape[0], w.shape[0])))
    # q4/q8 block kernels
    register("q4_gemm", lambda x, qs, d, m, bias: x.new_empty((x.shape[0], qs.shape[0])))
    register("q8_gemm", lambda x, qs, d, bias: x.new_empty((x.shape[0], qs.shape[0])))
    register("q4_gemm_packed",
             lambda x, qs, d, m, bias: x.new_empty((x.shape[0], qs.shape[0])))
    register("q8_gemm_packed", lambda x, qs, d, bias: x.new_empty((x.shape[0], qs.shape[0])))
    # the AVX2 tiles (panels of 16 outputs)
    register("tile_gemm_f32",
             lambda x, packed, bias: x.new_empty((x.shape[0], packed.shape[0] * 16)))
    register("tile_gemm_int8",
             lambda x, packed, scale, bias: x.new_empty((x.shape[0], packed.shape[0] * 16)))


def paged_decode_op(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    max_context: int = 0, scale: float = 1.0,
                    mask: torch.Tensor | None = None, *, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """The C++ decode kernel through the dispatcher (decode_attention's contract, with the
    layer options of paged_decode_cpu)."""
    if window is None and softcap is None:
        return torch.ops.tokenloom.paged_decode_cpu(q, key_cache, value_cache, block_tables,
                                                    context_lens, scale)
    return torch.ops.tokenloom.paged_decode_window_cpu(
        q, key_cache, value_cache, block_tables, context_lens, scale,
        0 if window is None else window, 0.0 if softcap is None else softcap)


paged_decode_op.options = ("window", "softcap")


def store_kv_op(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The C++ KV store through the dispatcher: slots < 0 skipped in place."""
    torch.ops.tokenloom.store_kv_cpu(key, value, key_cache, value_cache, slot_mapping)


def cache_key(model, kv: KVCache) -> str:
    """What a compiled program depends on besides the bucket (which Inductor keys itself):
    the model's shapes and dtype, the KV layout, torch, the CPU and the chosen kernels."""
    from tokenloom.kernels.cpu.features import detect

    parts = [repr(model.spec), str(model.embed_tokens.weight.dtype), str(kv.pool.dtype),
             str(tuple(kv.key[0].shape)), torch.__version__, detect().summary(),
             repr(getattr(model, "cpu_kernels", None))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def use_cache_dir(path: Path) -> None:
    """Point Inductor's on-disk caches (FX graphs, AOT autograd, compiled C++) at `path`.
    Read by Inductor whenever it compiles, so setting it before the first compile is enough."""
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    import torch._inductor.config as inductor_config
    inductor_config.fx_graph_cache = True
    try:
        import torch._functorch.config as functorch_config
        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):
        pass


def _layer_step(layer, m, h, cos, sin, kv_layer, meta, add_norm):
    """decoder.decoder_layer_step with the layer's K and V given as one [2, ...] pool view."""
    from tokenloom.kernels.models.decoder import decoder_layer_step
    return decoder_layer_step(layer, m, h, cos, sin, kv_layer[0], kv_layer[1], meta, add_norm)


class CompiledDecode:
    """One compiled program per bucket over shared static buffers; the same interface as
    graphs.capture.DecodeGraphs (`run`, `sizes`, replay counters) so the runner and the
    dispatcher need not know which kind of program a bucket replays."""

    def __init__(self, model, kv: KVCache, buffers: DecodeBuffers):
        self.model = model
        self.kv = kv
        self.buffers = buffers
        self.compiled: set[int] = set()
        self.failed: dict[int, str] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.num_replays = 0          # steps run by a compiled program
        self.num_static_eager = 0     # bucketed steps run eager (no program for the bucket)
        self._program = None
        self._closed = False

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.compiled))

    def _static_forward(self, size: int, step) -> torch.Tensor:
        """The decode step over the first `size` static rows, each decoder layer through
        `step` (the compiled layer, or the eager one)."""
        b = self.buffers
        model = self.model
        meta = b.meta(size)
        h = model.embed(b.input_ids[:size])
        ropes = model.rope_lookup(b.positions[:size])
        m = torch.zeros_like(h)
        pool = self.kv.pool
        for i, layer in enumerate(model.layers):
            cos, sin = ropes[layer.self_attn.local_rope]
            # The layer's K and V as one view of the pool: a single input that the KV store
            # updates in place. (K and V as two inputs aliasing one storage would make the
            # compiler rebuild and copy their common base around every store.)
            m, h = step(layer, m, h, cos, sin, pool[i], meta, model.add_norm_fn)
        return model.logits(h + m, b.logits_indices[:size])

    def _eager(self, size: int) -> torch.Tensor:
        b = self.buffers
        with torch.inference_mode(), self.model.layer_threads(b.input_ids[:size], b.meta(size)):
            return self._static_forward(size, _layer_step)

    def compile(self, sizes: tuple[int, ...], progress: bool = True) -> None:
        """Compile every bucket, largest first. A bucket that fails is dropped (its steps
        run eager) with the reason logged; the others are kept."""
        import torch._dynamo

        register_shape_functions()
        import torch._inductor.config as inductor_config
        # Round every intermediate to the model dtype where eager does (bf16): fused loops
        # otherwise keep fp32 in between, and programs would drift from the eager path.
        inductor_config.emulate_precision_casts = True
        # One program per bucket (room to spare: a guard that separates, say, the first
        # layer from the rest costs a second graph, not the bucket).
        limit = 4 * len(sizes) + 8
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
        # One compiled region per bucket, shared by every layer (they differ only in their
        # tensors): compiling it costs one layer's trace, not the whole model's. Dynamo keeps
        # its programs per code object, so each engine gets a code object of its own: two
        # engines in one process (a benchmark's fp32 and bf16 models) must not fill one
        # another's cache.
        step = types.FunctionType(_layer_step.__code__.replace(
            co_name=f"_layer_step_{next(_engine_ids)}"), _layer_step.__globals__)
        self._program = torch.compile(step, fullgraph=True, dynamic=False)
        order = sorted(sizes, reverse=True)
        bar = None
        if progress:
            try:
                from tqdm import tqdm
                bar = tqdm(total=len(order), desc="compiling CPU decode programs",
                           unit="bucket", leave=False)
            except ImportError:
                pass
        b = self.buffers
        t0 = time.perf_counter()
        try:
            for size in order:
                # Padding rows only: compiling runs the program once; it writes no KV.
                b.slot_mapping[:size].fill_(-1)
                b.context_lens[:size].fill_(1)
                b.input_ids[:size].zero_()
                b.positions[:size].zero_()
                try:
                    with torch.inference_mode(), self.model.layer_threads(b.input_ids[:size],
                                                                          b.meta(size)):
                        self._static_forward(size, self._program)
                    self.compiled.add(size)
                except Exception as e:  # a compiler problem: that bucket runs eager
                    self.failed[size] = f"{type(e).__name__}: {e}"[:500]
                    startup_log.warning(f"CPU decode program for batch {size} failed to "
                                        f"compile; that bucket runs eager",
                                        size=size, reason=self.failed[size])
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(batch=size)
        finally:
            if bar is not None:
                bar.close()
        self.capture_seconds = time.perf_counter() - t0
        self._closed = True
        if self.compiled:
            startup_log.info(f"CPU decode programs: {len(self.compiled)} buckets "
                             f"({min(self.compiled)}..{max(self.compiled)}) compiled in "
                             f"{self.capture_seconds:.1f}s", sizes=sorted(self.compiled),
                             seconds=round(self.capture_seconds, 2))

    def run(self, seqs: list[ScheduledSequence], padded: int, patch=None) -> torch.Tensor:
        """Fill the buffers and run the bucket's program (eagerly when it has none);
        logits [padded, vocab]. `patch` as in DecodeGraphs.run."""
        b = self.buffers
        b.fill(seqs, padded)
        if patch is not None:
            b.input_ids.index_copy_(0, patch[0], patch[1])
        if padded not in self.compiled:
            self.num_static_eager += 1
            return self._eager(padded)
        try:
            # Never compile on live traffic: a program whose guards fail raises instead.
            with torch.compiler.set_stance("fail_on_recompile"), torch.inference_mode(), \
                    self.model.layer_threads(b.input_ids[:padded], b.meta(padded)):
                logits = self._static_forward(padded, self._program)
        except Exception as e:
            self.compiled.discard(padded)
            self.failed[padded] = f"{type(e).__name__}: {e}"[:500]
            log.warning(f"CPU decode program for batch {padded} failed; that bucket runs "
                        "eager from now on", size=padded, reason=self.failed[padded])
            self.num_static_eager += 1
            return self._eager(padded)
        self.num_replays += 1
        return logits
