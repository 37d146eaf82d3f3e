"""Executes scheduled batches: builds inputs, runs the forward, samples.

Synchronous and single-threaded by contract: the runner actor calls `execute` from its one
dedicated compute thread. Keeps the little per-request state the sampler needs (params,
RNG, token history), mirrored from the scheduler's messages.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tokenloom.actors.batch_inputs import build_batch_inputs
from tokenloom.actors.messages import (ExecuteBatch, NewSequence, SampledToken, StepOutput,
                                       TokenLogprob)
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.llama import LlamaForCausalLM
from tokenloom.kernels.sampling import SamplingRow, make_generator, sample


@dataclasses.dataclass
class _SeqState:
    row: SamplingRow
    output_token_ids: list[int]


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device: torch.device,
                 eos_token_ids: tuple[int, ...]):
        self.model = model
        self.kv = kv
        self.device = device
        self.eos_token_ids = eos_token_ids
        self._seqs: dict[str, _SeqState] = {}

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

    def execute(self, batch: ExecuteBatch) -> StepOutput:
        t0 = time.perf_counter()
        for rid in batch.finished_ids:
            self._seqs.pop(rid, None)
        for s in batch.sequences:
            if s.new is not None:
                self._register(s.request_id, s.new)
        if not batch.sequences:
            return StepOutput(step=batch.step, sampled=[], compute_seconds=0.0)
        inputs = build_batch_inputs(batch, self.kv.block_size, self.device)
        logits = self.model(inputs.input_ids, inputs.positions, self.kv, inputs.meta,
                            inputs.logits_indices)                  # [S, vocab]
        sampled: list[SampledToken] = []
        if inputs.sample_ids:
            rows = [self._seqs[rid].row for rid in inputs.sample_ids]
            for rid, tok in zip(inputs.sample_ids, sample(logits, rows)):
                self._seqs[rid].output_token_ids.append(tok.token_id)
                lp = None
                if tok.logprob is not None:
                    lp = TokenLogprob(token_id=tok.token_id, logprob=tok.logprob,
                                      top=tok.top_logprobs)
                sampled.append(SampledToken(request_id=rid, token_id=tok.token_id, logprob=lp))
        return StepOutput(step=batch.step, sampled=sampled,
                          compute_seconds=time.perf_counter() - t0)

    def forward_logits(self, batch: ExecuteBatch) -> torch.Tensor:
        """The raw logits of a batch's sampled rows (for parity tests and debugging)."""
        inputs = build_batch_inputs(batch, self.kv.block_size, self.device)
        return self.model(inputs.input_ids, inputs.positions, self.kv, inputs.meta,
                          inputs.logits_indices)
