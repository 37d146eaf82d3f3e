"""Piecewise CUDA graphs: steps with prefill tokens replay everything but attention.

A decode graph (graphs/capture.py) captures a whole decode step, attention included, which
works because a decode row's attention is one fixed-shape kernel. A step with prefill
chunks cannot be captured whole: its attention depends on how its tokens split into
sequences and contexts. Everything else in the forward only depends on the number of
tokens. So, as vLLM does, the forward is cut at attention into L + 1 pieces for an L-layer
model, each captured once per token-count bucket and replayed with attention run eagerly
in between:

    piece 0:      embedding, RoPE table lookup, layer 0 up to attention (q; k and v stored)
    attention 0:  eager (the step's real metadata: decodes, then each prefill chunk)
    piece i:      layer i-1 after attention (o_proj, norms, MLP), layer i up to attention
    ...
    piece L:      the last layer after attention, the final residual add

The LM head runs eagerly on the sampled rows only (their number varies per step). Where an
eager mixed step of a 30-layer model launches ~20 kernels a layer (more with the torch
reference norm), a piecewise step launches 31 graphs and a few attention kernels a layer.

Tensors that cross a piece boundary (q, attention's output, the residual stream, cos/sin)
live in static buffers allocated once at the largest bucket; a piece reads and writes the
first `padded` rows. Padded rows carry token 0 at position 0 with KV slot -1 (the store
kernels skip it) and are never attended: attention only sees the real rows, and every other
op is row-wise, so padding never changes a real row.

Everything but `torch.cuda.graph` runs on CPU too (`PiecewiseGraphs.run` executes the
pieces eagerly over the same buffers when a bucket has no graphs), which is how the CPU
tests check buffers, padding and the cut against the plain forward.
"""

from __future__ import annotations

import torch

from tokenloom.graphs.capture import (
    CaptureClosedError,
    CaptureError,
    capture_allowed,
    capture_buckets,
)
from tokenloom.kernels.attention import with_chunk_masks
from tokenloom.kernels.forward_context import AttentionMetadata
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.models.decoder import layer_after_attention, layer_before_attention

PAD_SLOT = -1


class PiecewiseBuffers:
    """Static inputs and the tensors that cross piece boundaries, for up to `max_tokens`."""

    def __init__(self, model, max_tokens: int, device: torch.device | str):
        spec = model.spec
        dtype = model.embed_tokens.weight.dtype
        dev = torch.device(device)
        self.max_tokens = max_tokens
        self.device = dev
        ids = torch.zeros((3, max_tokens), dtype=torch.int64, device=dev)
        ids[2] = PAD_SLOT
        self._vectors = ids
        self.input_ids, self.positions, self.slot_mapping = ids[0], ids[1], ids[2]
        self.hidden = torch.zeros((max_tokens, spec.hidden_size), dtype=dtype, device=dev)
        self.q = torch.zeros((max_tokens, spec.num_heads, spec.head_dim), dtype=dtype,
                             device=dev)
        self.attn_out = torch.zeros((max_tokens, spec.q_size), dtype=dtype, device=dev)
        self.cos = torch.zeros((max_tokens, 1, spec.head_dim), dtype=dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        # What padded rows hold, copied in one device-to-device copy per step.
        self._pad = torch.zeros_like(ids)
        self._pad[2] = PAD_SLOT

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor,
             slot_mapping: torch.Tensor, padded: int) -> None:
        """The step's first T rows (device tensors, as the eager path built them); rows
        [T, padded) get token 0 at position 0 and slot -1."""
        t = input_ids.shape[0]
        assert 0 < t <= padded <= self.max_tokens, f"cannot pad {t} tokens to {padded}"
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(slot_mapping)
        if t < padded:
            self._vectors[:, t:padded].copy_(self._pad[:, : padded - t])


class PiecewiseGraphs:
    """L + 1 captured pieces per token-count bucket over shared static buffers."""

    def __init__(self, model, kv: KVCache, buffers: PiecewiseBuffers, pool=None):
        self.model = model
        self.kv = kv
        self.buffers = buffers
        self.pool = pool              # shared with the decode graphs (never run concurrently)
        self.graphs: dict[int, list] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.num_replays = 0          # steps whose pieces replayed captured graphs
        self.num_static_eager = 0     # steps whose pieces ran eagerly (no graphs: CPU)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    @property
    def num_pieces(self) -> int:
        return len(self.model.layers) + 1

    # -- the pieces (captured on CUDA; run eagerly on CPU and for warm-up) ------------------
    def run_piece(self, j: int, padded: int) -> None:
        """Piece j over the first `padded` rows of the buffers (see the module docstring)."""
        b, model = self.buffers, self.model
        layers, add_norm = model.layers, model.add_norm_fn
        h = b.hidden[:padded]
        cos, sin = b.cos[:padded], b.sin[:padded]
        if j == 0:
            h.copy_(model.embed_tokens(b.input_ids[:padded]))
            c, s = model.rope.lookup(b.positions[:padded])
            cos.copy_(c)
            sin.copy_(s)
            m = torch.zeros_like(h)
        else:
            m, h2 = layer_after_attention(layers[j - 1], b.attn_out[:padded], h, add_norm)
            if h2.data_ptr() != h.data_ptr():   # the torch norm returns a new residual
                h.copy_(h2)
        if j == len(layers):
            h.add_(m)
            return
        q, h2 = layer_before_attention(layers[j], m, h, cos, sin, self.kv.key[j],
                                       self.kv.value[j], b.slot_mapping[:padded], add_norm)
        if h2.data_ptr() != h.data_ptr():
            h.copy_(h2)
        b.q[:padded].copy_(q)

    def attend(self, j: int, meta: AttentionMetadata, t: int) -> None:
        """Layer j's attention for the step's t real rows, into the static output."""
        b = self.buffers
        attn = self.model.layers[j].self_attn
        o = attn.attend(b.q[:t], self.kv.key[j], self.kv.value[j], meta)
        b.attn_out[:t].copy_(o.reshape(t, -1))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, padded: int) -> torch.Tensor:
        """The residual stream after the last layer for the step's T tokens, [T, hidden]
        (a view of the static buffer: use it before the next step)."""
        t = input_ids.shape[0]
        self.buffers.fill(input_ids, positions, meta.slot_mapping, padded)
        meta = with_chunk_masks(meta, self.buffers.hidden.dtype)   # once, not per layer
        graphs = self.graphs.get(padded)
        if graphs is None:
            self.num_static_eager += 1
        else:
            self.num_replays += 1
        for j in range(self.num_pieces):
            if graphs is None:
                self.run_piece(j, padded)
            else:
                graphs[j].replay()
            if j < len(self.model.layers):
                self.attend(j, meta, t)
        return self.buffers.hidden[:t]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_indices: torch.Tensor, padded: int) -> torch.Tensor:
        """The sampled rows' logits [S, vocab] (fp32), as `model(...)` returns them."""
        with torch.inference_mode():
            return self.model.logits(self.run_hidden(input_ids, positions, meta, padded),
                                     logits_indices)

    def run_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, padded: int) -> torch.Tensor:
        """The residual stream [T, hidden] (a view of the static buffer, as
        `hidden_states`), as `model.forward_hidden` returns it."""
        with torch.inference_mode():
            self.model.prepare()
            return self.hidden_states(input_ids, positions, meta, padded)

    def replay_each(self) -> None:
        """Replay every bucket's pieces once over padding tokens (no KV written; attention's
        output buffer holds finite old values) before the server is ready, so a piece that
        cannot replay, or replays to non-finite values, fails start-up's capture instead of
        a request."""
        b = self.buffers
        b.slot_mapping.fill_(PAD_SLOT)
        for size, pieces in sorted(self.graphs.items()):
            for graph in pieces:
                graph.replay()
            if not bool(torch.isfinite(b.hidden[:size]).all()):
                raise RuntimeError(f"the pieces for {size} tokens replayed to non-finite values")
        torch.cuda.synchronize()

    # -- capture ---------------------------------------------------------------------------
    def capture_one(self, padded: int, warmup: int = 2) -> None:
        if not capture_allowed():
            raise CaptureClosedError(f"piecewise graph capture for {padded} tokens attempted "
                                     "after start-up capture closed")
        b = self.buffers
        # Padding rows only: nothing is stored (slot -1); attention is not part of a piece.
        b.slot_mapping[:padded].fill_(PAD_SLOT)
        b.input_ids[:padded].zero_()
        b.positions[:padded].zero_()
        pieces = []
        with torch.inference_mode():
            for j in range(self.num_pieces):
                for _ in range(warmup):
                    self.run_piece(j, padded)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.run_piece(j, padded)
                if self.pool is None:
                    self.pool = graph.pool()
                pieces.append(graph)
        self.graphs[padded] = pieces

    def capture(self, sizes: tuple[int, ...], memory_budget_bytes: int,
                progress: bool = True) -> None:
        """Capture every bucket, largest first; raise CaptureError (all pieces dropped) on
        failure or when they take more than `memory_budget_bytes` of device memory."""
        if not torch.cuda.is_available() or self.buffers.device.type != "cuda":
            raise CaptureError("CUDA graphs need a CUDA device")
        assert max(sizes) <= self.buffers.max_tokens, "buffers are smaller than the largest bucket"
        self.capture_seconds, self.capture_bytes = capture_buckets(
            sizes, self.capture_one, self.replay_each, self.graphs.clear, progress=progress,
            label=f"piecewise buckets ({self.num_pieces} pieces each)", unit="bucket",
            postfix="tokens", budget=memory_budget_bytes,
            budget_name="what the decode graphs left of the budget")
