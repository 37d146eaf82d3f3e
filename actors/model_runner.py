"""Executes scheduled batches: builds inputs, runs the forward, samples.

Graph or eager is decided per step by the dispatcher (graphs/dispatch.py), the one place
that decides it: decode-only batches up to the largest bucket replay a captured CUDA graph
over static buffers; everything else (and everything on CPU) runs the eager forward.

Synchronous and single-threaded by contract: the runner actor calls `execute` from its one
dedicated compute thread. Keeps the little per-request state the sampler needs (params,
RNG, token history), mirrored from the scheduler's messages.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tokenloom.actors.batch_inputs import build_batch_inputs
from tokenloom.graphs.capture import DecodeGraphs
from tokenloom.graphs.dispatch import GRAPH, Dispatcher
from tokenloom.actors.messages import (PLACEHOLDER, ExecuteBatch, NewSequence, SampledToken,
                                       StepOutput, TokenLogprob)
from tokenloom.kernels.kv_store import HostKVPool, KVCache
from tokenloom.kernels.llama import LlamaForCausalLM
from tokenloom.kernels.sampling import SamplingRow, make_generator, sample


@dataclasses.dataclass
class _SeqState:
    row: SamplingRow
    output_token_ids: list[int]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device: torch.device,
                 eos_token_ids: tuple[int, ...], graphs: DecodeGraphs | None = None,
                 dispatcher: Dispatcher | None = None, host_pool: HostKVPool | None = None):
        self.model = model
        self.kv = kv
        self.host_pool = host_pool  # swap preemption's host memory (None: swap is off)
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.graphs = graphs
        self.dispatcher = dispatcher or Dispatcher(None, "eager only")
        assert graphs is not None or self.dispatcher.table is None, "a graph table needs graphs"
        self._seqs: dict[str, _SeqState] = {}
        # Requests of a step that failed: later batches (already queued when steps overlap)
        # skip them until the scheduler reports them finished.
        self._failed: set[str] = set()

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)

    def _register(self, request_id: str, new: NewSequence) -> None:
        state = self._seqs.get(request_id)
        outputs = list(new.output_token_ids)
        if state is not None:
            # Resumed after preemption: keep the RNG so seeded output is unchanged.
            state.output_token_ids[:] = outputs
            return
        p = new.sampling_params
        gen = None if p.is_greedy else make_generator(p.seed, self.device)
        row = SamplingRow(params=p, generator=gen, prompt_token_ids=list(new.prompt_token_ids),
                          output_token_ids=outputs, eos_token_ids=self.eos_token_ids)
        self._seqs[request_id] = _SeqState(row=row, output_token_ids=outputs)

    def forget_failed(self, batch: ExecuteBatch) -> None:
        """The step raised: drop its requests' state (the scheduler fails them) and skip
        them in batches that were planned before the scheduler heard of it."""
        for s in batch.sequences:
            self._seqs.pop(s.request_id, None)
            self._failed.add(s.request_id)

    def _resolve_inputs(self, batch: ExecuteBatch) -> None:
        """Drop sequences of failed requests; replace each PLACEHOLDER with the token its
        request sampled in the previous step (overlapped steps: the scheduler planned this
        step before that token came back)."""
        if self._failed:
            keep = [s for s in batch.sequences if s.request_id not in self._failed]
            batch.num_decodes -= sum(s.request_id in self._failed
                                     for s in batch.sequences[:batch.num_decodes])
            batch.sequences = keep
        for s in batch.sequences[:batch.num_decodes]:
            if s.token_ids[-1] == PLACEHOLDER:
                s.token_ids[-1] = self._seqs[s.request_id].output_token_ids[-1]

    def execute(self, batch: ExecuteBatch) -> StepOutput:
        t0 = time.perf_counter()
        for rid in batch.finished_ids:
            self._seqs.pop(rid, None)
            self._failed.discard(rid)
        for s in batch.sequences:
            if s.new is not None:
                self._register(s.request_id, s.new)
        self._resolve_inputs(batch)
        swap_seconds = 0.0
        if batch.swap_out or batch.swap_in:  # swap preemption, before anything reuses blocks
            t_swap = time.perf_counter()
            if batch.swap_out:
                self.host_pool.swap_out(self.kv, batch.swap_out)
            if batch.swap_in:
                self.host_pool.swap_in(self.kv, batch.swap_in)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            swap_seconds = time.perf_counter() - t_swap
        if batch.block_copies:  # copy-on-write of forked siblings' partial blocks
            self.kv.copy_blocks(batch.block_copies)
        if not batch.sequences:
            return StepOutput(step=batch.step, sampled=[], compute_seconds=0.0,
                              swap_seconds=swap_seconds)
        logits, sample_ids = self._forward(batch)                   # [S, vocab]
        sampled: list[SampledToken] = []
        if sample_ids:
            states = [self._seqs[rid] for rid in sample_ids]
            for rid, state, tok in zip(sample_ids, states, sample(logits, [s.row for s in states])):
                state.output_token_ids.append(tok.token_id)
                lp = None
                if tok.logprob is not None:
                    lp = TokenLogprob(token_id=tok.token_id, logprob=tok.logprob,
                                      top=tok.top_logprobs)
                sampled.append(SampledToken(request_id=rid, token_id=tok.token_id, logprob=lp))
        return StepOutput(step=batch.step, sampled=sampled,
                          compute_seconds=time.perf_counter() - t0, swap_seconds=swap_seconds)

    def _reference_decode(self) -> bool:
        # Only the torch reference decode reads a precomputed mask; kernels do without.
        return self.model.layers[0].self_attn.decode_fn is None

    def forward_logits(self, batch: ExecuteBatch) -> torch.Tensor:
        """The raw logits of a batch's sampled rows (for parity tests and debugging)."""
        return self._forward(batch)[0].clone()

    def graph_stats(self) -> dict:
        stats = self.dispatcher.stats()
        if self.graphs is not None:
            stats["captured_sizes"] = list(self.graphs.sizes)
            stats["capture_seconds"] = self.graphs.capture_seconds
            stats["capture_bytes"] = self.graphs.capture_bytes
        return stats

    def _forward(self, batch: ExecuteBatch) -> tuple[torch.Tensor, list[str]]:
        """Logits of the rows to sample [S, vocab] and their request ids."""
        seqs = batch.sequences
        num_tokens = sum(len(s.token_ids) for s in seqs)
        decision = self.dispatcher.dispatch(len(seqs), batch.num_decodes, num_tokens)
        if decision.mode == GRAPH:
            logits = self.graphs.run(seqs, decision.padded_size)    # [padded, vocab], static
            rows = [i for i, s in enumerate(seqs) if s.sample]
            sample_ids = [seqs[i].request_id for i in rows]
            if len(rows) == len(seqs):          # every decode samples: a view, no copy
                return logits[: len(seqs)], sample_ids
            return logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)], sample_ids
        inputs = build_batch_inputs(batch, self.kv.block_size, self.device,
                                    with_decode_mask=self._reference_decode())
        logits = self.model(inputs.input_ids, inputs.positions, self.kv, inputs.meta,
                            inputs.logits_indices)
        return logits, inputs.sample_ids
