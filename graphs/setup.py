"""Start-up: from the `[graphs]` config to a dispatcher and captured decode graphs, or to a
stated reason why decode runs eager.

Graphs are a CUDA-only speed-up with a kill switch (`graphs.enforce_eager`); any failure
here is logged with its reason (on the "tokenloom.startup" logger) and the engine keeps
serving on the eager path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tokenloom.arith import cdiv
from tokenloom.config.schema import ConfigError, GraphsConfig
from tokenloom.graphs.buckets import PaddedSizeTable, capture_sizes, default_token_sizes
from tokenloom.graphs.buffers import DecodeBuffers
from tokenloom.graphs.capture import CaptureError, DecodeGraphs
from tokenloom.graphs.dispatch import Dispatcher
from tokenloom.graphs.piecewise import PiecewiseBuffers, PiecewiseGraphs
from tokenloom.kernels.kv_store import KVCache
from tokenloom.startup_log import startup_log

REFERENCE_MAX_CONTEXT = 4096


def read_histogram(path: str | Path) -> dict[int, int]:
    """A JSON object {batch_size: count} (keys may be strings), e.g. the runner's
    `decode_batch_size_histogram` stat saved to a file."""
    try:
        raw = json.loads(Path(path).expanduser().read_text())
        hist = {int(k): int(v) for k, v in raw.items()}
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise ConfigError(f"graphs.histogram_path {path}: not a JSON object of "
                          f"batch size -> count ({e})", key="graphs.histogram_path") from e
    return hist


def resolve_capture_sizes(cfg: GraphsConfig, max_num_seqs: int) -> tuple[int, ...]:
    histogram = read_histogram(cfg.histogram_path) if cfg.histogram_path else None
    return capture_sizes(max_num_seqs, cfg.capture_sizes, cfg.max_capture_size, histogram,
                         cfg.max_graphs)


def build_decode_graphs(cfg: GraphsConfig, model, kv: KVCache, *, max_num_seqs: int,
                        max_model_len: int, device: torch.device,
                        cache_dir: Path | None = None) -> tuple[Dispatcher, DecodeGraphs | None]:
    """Capture on CUDA, compile on CPU (unless disabled); otherwise an eager-only
    dispatcher with its reason."""
    reason = None
    if getattr(model.rope, "long_offset", 0):
        # Static decode programs rotate by position; a longrope model's rows depend on each
        # sequence's length at admission too.
        reason = "a longrope model's RoPE rows depend on the sequence"
    elif model.kv_groups.num_groups > 1:
        # (their static buffers hold one block table per row)
        reason = "the model's layer groups keep a block table each"
    if reason is not None:
        startup_log.info(f"decode programs off: {reason}; decode runs eager", reason=reason)
        return Dispatcher(None, reason), None
    if device.type == "cpu":
        return build_cpu_programs(cfg, model, kv, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, cache_dir=cache_dir)
    if device.type != "cuda":
        return Dispatcher(None, f"eager on {device.type}"), None
    width = cdiv(max_model_len, kv.block_size) * kv.block_size
    graphs_possible = not cfg.enforce_eager and model.layers[0].self_attn.store_fn is not None
    precompile_decode(model, kv, max_num_seqs=max_num_seqs, width=width,
                      graph_sizes=resolve_capture_sizes(cfg, max_num_seqs) if graphs_possible
                      else ())
    if cfg.enforce_eager:
        startup_log.info("CUDA graphs off (graphs.enforce_eager); decode runs eager")
        return Dispatcher(None, "graphs.enforce_eager"), None
    if model.layers[0].self_attn.store_fn is None:
        reason = "no graph-safe KV store kernel (Triton unavailable)"
        startup_log.info(f"CUDA graphs disabled: {reason}; decode runs eager", reason=reason)
        return Dispatcher(None, reason), None
    if model.layers[0].self_attn.decode_fn is None and width > REFERENCE_MAX_CONTEXT:
        # The reference decode gathers every row's whole block table inside the graph.
        reason = (f"the torch reference attention would gather {width} tokens per row in every "
                  f"graph (limit {REFERENCE_MAX_CONTEXT}); use model.attention_backend auto")
        startup_log.info(f"CUDA graphs disabled: {reason}; decode runs eager", reason=reason)
        return Dispatcher(None, reason), None
    sizes = resolve_capture_sizes(cfg, max_num_seqs)
    buffers = DecodeBuffers(max(sizes), cdiv(max_model_len, kv.block_size), kv.block_size,
                            model.spec.vocab_size, device)
    if has_lora(model):
        buffers.lora = True
    graphs = DecodeGraphs(model, kv, buffers)
    try:
        graphs.capture(sizes, cfg.memory_budget_bytes)
    except CaptureError as e:
        startup_log.warning(f"CUDA graphs disabled: {e}; decode runs eager", reason=str(e))
        graphs = buffers = None  # drop the partial capture before emptying the cache
        torch.cuda.empty_cache()
        return Dispatcher(None, str(e)), None
    if not graphs.sizes:
        return Dispatcher(None, "no bucket captured"), None
    # The buckets actually captured (the memory budget may stop capture early), so that a
    # batch without a graph is dispatched, and counted, as eager with its reason.
    return Dispatcher(PaddedSizeTable(graphs.sizes)), graphs


def has_lora(model) -> bool:
    """The model applies LoRA deltas ([lora] on): its programs read per-row slots."""
    return model.layers[0].self_attn.lora_qkv is not None


def resolve_token_sizes(cfg: GraphsConfig, max_num_batched_tokens: int) -> tuple[int, ...]:
    """Piecewise buckets: `graphs.piecewise_token_sizes` (those within the step budget), or
    the default ladder up to min(graphs.piecewise_max_tokens, the step's token budget)."""
    cap = min(cfg.piecewise_max_tokens, max_num_batched_tokens)
    if cfg.piecewise_token_sizes:
        kept = sorted({s for s in cfg.piecewise_token_sizes if s <= max_num_batched_tokens})
        if not kept:
            raise ConfigError(f"graphs.piecewise_token_sizes: none is <= "
                              f"scheduler.max_num_batched_tokens ({max_num_batched_tokens})",
                              key="graphs.piecewise_token_sizes")
        return tuple(kept)
    return default_token_sizes(cap)


def build_piecewise_graphs(cfg: GraphsConfig, model, kv: KVCache, dispatcher: Dispatcher,
                           decode_graphs: DecodeGraphs | None, *, max_num_batched_tokens: int,
                           device: torch.device) -> PiecewiseGraphs | None:
    """CUDA: capture piecewise graphs for steps with prefill tokens (graphs/piecewise.py)
    after the decode graphs, in their memory pool, and give the dispatcher their token
    buckets; otherwise leave those steps eager with the reason logged and counted."""
    if device.type != "cuda":
        return None   # CPU: compiled programs cover decode only; mixed steps run eager
    reason = None
    if cfg.enforce_eager:
        reason = "graphs.enforce_eager"
    elif not cfg.piecewise:
        reason = "graphs.piecewise is off"
    elif model.layers[0].self_attn.store_fn is None:
        reason = "no graph-safe KV store kernel (Triton unavailable)"
    elif has_lora(model):
        # (the pieces' static buffers carry no per-row adapter slots yet)
        reason = "LoRA adapters are served"
    elif getattr(model.rope, "long_offset", 0) or model.rope_local is not None:
        # (their static cos/sin buffers hold one table's rows by position)
        reason = "the model's RoPE needs more than one table"
    elif model.kv_groups.num_groups > 1:
        reason = "the model's layer groups keep a block table each"
    if reason is not None:
        dispatcher.piecewise_reason = f"prefill in batch ({reason})"
        startup_log.info(f"piecewise CUDA graphs off ({reason}); steps with prefill tokens "
                         "run eager", reason=reason)
        return None
    sizes = resolve_token_sizes(cfg, max_num_batched_tokens)
    budget = cfg.memory_budget_bytes - (decode_graphs.capture_bytes if decode_graphs else 0)
    pieces = PiecewiseGraphs(model, kv, PiecewiseBuffers(model, max(sizes), device),
                             pool=decode_graphs.pool if decode_graphs is not None else None)
    try:
        pieces.capture(sizes, budget)
    except CaptureError as e:
        startup_log.warning(f"piecewise CUDA graphs disabled: {e}; steps with prefill tokens "
                            "run eager", reason=str(e))
        dispatcher.piecewise_reason = f"prefill in batch ({e})"
        pieces = None
        torch.cuda.empty_cache()
        return None
    dispatcher.token_table = PaddedSizeTable(pieces.sizes)
    return pieces


def precompile_decode(model, kv: KVCache, *, max_num_seqs: int, width: int,
                      graph_sizes: tuple[int, ...]) -> None:
    """Compile every Triton decode-attention variant this server can meet (each partition
    the split rule can pick for 1..max_num_seqs rows up to `width` tokens, and for each graph
    bucket), so none compiles on live traffic. If one fails, decode attention falls back to
    the torch reference, for graphs and eager alike, with the reason logged."""
    decode_fn = model.layers[0].self_attn.decode_fn
    if not hasattr(decode_fn, "server_variants"):   # not the Triton split kernel
        return
    variants = decode_fn.server_variants(max_num_seqs, width, graph_sizes)
    t0 = time.perf_counter()
    try:
        decode_fn.precompile_for(variants, kv)   # a quantized cache's variants too
        if kv.pool is not None and kv.pool.is_cuda:
            torch.cuda.synchronize()
    except Exception as e:  # a variant the smoke test did not cover failed to build or run
        reason = f"precompiling its variants failed: {type(e).__name__}: {e}"
        startup_log.warning(f"Triton decode attention off ({reason}); decode attention runs "
                            "the torch reference", backend="torch", reason=reason)
        model.set_decode_kernel(None)
        return
    seconds = time.perf_counter() - t0
    parts = sorted({v.partition for v in variants})
    startup_log.info(f"decode attention: {len(variants)} Triton variants compiled in "
                     f"{seconds:.1f}s (partitions {parts[0]}..{parts[-1]} tokens, "
                     f"{decode_fn.rule.sm_count} SMs)", variants=len(variants),
                     seconds=round(seconds, 2), partitions=parts)


def build_cpu_programs(cfg: GraphsConfig, model, kv: KVCache, *, max_num_seqs: int,
                       max_model_len: int, cache_dir: Path | None):
    """CPU: a compiled decode program per bucket (graphs/cpu_compile.py), or eager with the
    reason logged."""
    from tokenloom.graphs.cpu_compile import (
        CompiledDecode,
        cache_key,
        paged_decode_op,
        store_kv_op,
        use_cache_dir,
    )
    from tokenloom.kernels.cpu.attention import cpu_kernel_status, paged_decode_cpu

    reason = None
    if cfg.enforce_eager:
        reason = "graphs.enforce_eager"
    elif not cfg.cpu_compile:
        reason = "graphs.cpu_compile is off"
    elif kv.quantized:
        # The programs take each layer's pool slice as one tensor in the model dtype.
        reason = "the KV cache is quantized (cache.kv_dtype); the quantized kernels run eager"
    elif model.layers[0].self_attn.decode_fn is not paged_decode_cpu:
        reason = f"needs the C++ decode kernel ({cpu_kernel_status()})"
    sizes = tuple(s for s in sorted(set(cfg.cpu_capture_sizes)) if s <= max_num_seqs)
    if reason is None and not sizes:
        reason = f"no graphs.cpu_capture_sizes <= scheduler.max_num_seqs ({max_num_seqs})"
    if reason is not None:
        startup_log.info(f"CPU decode programs off ({reason}); decode runs eager", reason=reason)
        return Dispatcher(None, reason), None
    if model.plan_cache_dir is None and cache_dir is not None:
        model.plan_cache_dir = cache_dir   # the same kernels next start: programs stay cached
    model.prepare()   # the kernel per batch size is chosen first: each program calls it
    untraceable = [s for s in sizes if not traced_as_planned(model, s)]
    if untraceable:
        # Measured fastest here for these batch sizes: a kernel a program cannot call
        # (oneDNN's packed weights). A program would run a slower one, so they stay eager.
        sizes = tuple(s for s in sizes if s not in untraceable)
        startup_log.info(f"CPU decode programs: batch sizes {untraceable} stay eager (their "
                         f"fastest measured kernels cannot be compiled)", eager=untraceable)
        if not sizes:
            reason = "no bucket's measured kernels can be compiled"
            startup_log.info(f"CPU decode programs off ({reason}); decode runs eager",
                             reason=reason)
            return Dispatcher(None, reason), None
    # The programs call the C++ kernels as dispatcher ops (the eager path does too, so both
    # run the same kernels).
    model.set_decode_kernel(paged_decode_op)
    model.set_kv_store_kernel(store_kv_op)
    if cache_dir is not None:
        use_cache_dir(Path(cache_dir) / "cpu_programs" / cache_key(model, kv))
    buffers = DecodeBuffers(max(sizes), cdiv(max_model_len, kv.block_size), kv.block_size,
                            model.spec.vocab_size, "cpu")
    if has_lora(model):
        buffers.lora = True
    programs = CompiledDecode(model, kv, buffers)
    programs.compile(sizes)
    if not programs.sizes:
        reason = "no CPU decode program compiled: " + "; ".join(
            f"{k}: {v}" for k, v in sorted(programs.failed.items()))
        startup_log.warning(f"{reason}; decode runs eager", reason=reason)
        return Dispatcher(None, reason), None
    return Dispatcher(PaddedSizeTable(programs.sizes)), programs


def traced_as_planned(model, rows: int) -> bool:
    """Whether a program of `rows` rows calls the kernels the eager path would (the ones
    measured fastest for that many rows), for every projection and the head."""
    from tokenloom.kernels.cpu.linear import CpuLinear

    return all(m.kernel_for(rows) == m.traced_kernel_for(rows)
               for m in model.modules() if isinstance(m, CpuLinear))
