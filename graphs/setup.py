"""Start-up: from the `[graphs]` config to a dispatcher and captured decode graphs, or to a
stated reason why decode runs eager.

Graphs are a CUDA-only speed-up with a kill switch (`graphs.enforce_eager`); any failure
here is logged with its reason (on the "tokenloom.startup" logger) and the engine keeps
serving on the eager path.
"""

from __future__ import annotations

import json
from pathlib import Path

import structlog
import torch

from tokenloom.config.schema import ConfigError, GraphsConfig
from tokenloom.graphs.buckets import PaddedSizeTable, capture_sizes
from tokenloom.graphs.buffers import DecodeBuffers
from tokenloom.graphs.capture import CaptureError, DecodeGraphs
from tokenloom.graphs.dispatch import Dispatcher
from tokenloom.kernels.kv_store import KVCache

startup_log = structlog.get_logger("tokenloom.startup", logger_name="tokenloom.startup")
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
                        max_model_len: int, device: torch.device
                        ) -> tuple[Dispatcher, DecodeGraphs | None]:
    """Capture on CUDA (unless disabled); otherwise an eager-only dispatcher with its reason."""
    if device.type != "cuda":
        return Dispatcher(None, "eager on CPU"), None
    if cfg.enforce_eager:
        startup_log.info("CUDA graphs off (graphs.enforce_eager); decode runs eager")
        return Dispatcher(None, "graphs.enforce_eager"), None
    if model.layers[0].self_attn.store_fn is None:
        reason = "no graph-safe KV store kernel (Triton unavailable)"
        startup_log.info(f"CUDA graphs disabled: {reason}; decode runs eager", reason=reason)
        return Dispatcher(None, reason), None
    width = -(-max_model_len // kv.block_size) * kv.block_size
    if model.layers[0].self_attn.decode_fn is None and width > REFERENCE_MAX_CONTEXT:
        # The reference decode gathers every row's whole block table inside the graph.
        reason = (f"the torch reference attention would gather {width} tokens per row in every "
                  f"graph (limit {REFERENCE_MAX_CONTEXT}); use model.attention_backend auto")
        startup_log.info(f"CUDA graphs disabled: {reason}; decode runs eager", reason=reason)
        return Dispatcher(None, reason), None
    sizes = resolve_capture_sizes(cfg, max_num_seqs)
    buffers = DecodeBuffers(max(sizes), -(-max_model_len // kv.block_size), kv.block_size,
                            model.spec.vocab_size, device)
    graphs = DecodeGraphs(model, kv, buffers)
    try:
        graphs.capture(sizes, cfg.memory_budget_bytes)
    except CaptureError as e:
        startup_log.warning(f"CUDA graphs disabled: {e}; decode runs eager", reason=str(e))
        graphs = buffers = None  # drop the partial capture before emptying the cache
        torch.cuda.empty_cache()
        return Dispatcher(None, f"capture failed: {e}"), None
    if not graphs.sizes:
        return Dispatcher(None, "no bucket captured"), None
    # The buckets actually captured (the memory budget may stop capture early), so that a
    # batch without a graph is dispatched, and counted, as eager with its reason.
    return Dispatcher(PaddedSizeTable(graphs.sizes)), graphs
