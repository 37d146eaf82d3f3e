"""Executes scheduled batches: builds inputs, runs the forward, samples.

How a step runs is decided by the dispatcher (graphs/dispatch.py), the one place that
decides it: decode-only batches up to the largest bucket replay a captured CUDA graph over
static buffers; on CUDA, other steps up to the largest token bucket replay piecewise graphs
with attention run eagerly in between (graphs/piecewise.py); the rest (and everything on
CPU without compiled programs) runs the eager forward.

Synchronous and single-threaded by contract: the runner actor calls `execute` from its one
dedicated compute thread. Keeps the little per-request state the sampler needs (params,
RNG, token history), mirrored from the scheduler's messages.
"""

from __future__ import annotations

import dataclasses
import time

import msgspec
import numpy as np
import structlog
import torch

from tokenloom.actors.execution import prompt_logprobs
from tokenloom.actors.execution.batch_inputs import LongRope, build_batch_inputs
from tokenloom.actors.execution.guided import GuidedMatcher
from tokenloom.actors.execution.guided_masks import GuidedMasks, no_token_error
from tokenloom.actors.execution.pooling import Pooler
from tokenloom.actors.messages import (
    PLACEHOLDER,
    ExecuteBatch,
    GraphStats,
    KVQuantStats,
    NewSequence,
    SampledToken,
    SpecResult,
    StepOutput,
    TokenLogprob,
)
from tokenloom.graphs.capture import DecodeGraphs
from tokenloom.graphs.dispatch import GRAPH, PIECEWISE, Dispatcher
from tokenloom.graphs.piecewise import PiecewiseGraphs
from tokenloom.kernels.kv_store import HostKVPool, KVCache, gather_blocks, scatter_blocks
from tokenloom.kernels.models.decoder import CausalLM
from tokenloom.kernels.sampling import (
    Sample,
    SamplingRow,
    make_generator,
    reads_host_history,
    sample,
)
from tokenloom.kernels.sampling import sample_ids as sample_ids_on_device
from tokenloom.kernels.spec_verify import Proposal, expand_rows, verify

log = structlog.get_logger("tokenloom.runner")


@dataclasses.dataclass
class LaunchedStep:
    """A step whose forward and sampling are launched; `finish` brings its tokens home."""
    batch: ExecuteBatch
    t0: float
    swap_seconds: float = 0.0
    sample_ids: list[str] = dataclasses.field(default_factory=list)
    row_of: dict[str, int] = dataclasses.field(default_factory=dict)  # request -> token row
    token_ids: torch.Tensor | None = None   # [S] on the device (no logprobs wanted)
    samples: list | None = None             # host Samples (logprobs wanted: synced at once)
    event: object | None = None             # CUDA event recorded after sampling
    # Speculative steps: each sampled request's emitted tokens (accepted drafts, then one).
    emitted: dict[str, list[Sample]] | None = None
    idle_seconds: float = 0.0               # how long the runner waited for this batch
    # Chunks that asked for prompt logprobs: their rows and values (on the device).
    prompt: tuple | None = None
    # Pooling requests whose prompt this step completed: (request, vector on the device or
    # an error); `finish` turns them into `pooled_outputs` (messages.PooledOutput).
    pooled: list = dataclasses.field(default_factory=list)
    pooled_outputs: list = dataclasses.field(default_factory=list)

    def done(self) -> bool:
        return self.event is None or self.event.query()


@dataclasses.dataclass
class _SeqState:
    row: SamplingRow
    output_token_ids: list[int]
    # The distributions the draft model drew its last proposals from ([k, vocab]), kept
    # for their verification; None for deterministic proposals (prompt lookup).
    draft_probs: torch.Tensor | None = None
    # Guided decoding: the request's grammar position (None: unconstrained).
    matcher: GuidedMatcher | None = None
    # A longrope model: the sequence was (re)admitted longer than the original window, so
    # all of it rotates with the long factors (layers.longrope_rows).
    long_rope: bool = False


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device,
                 eos_token_ids: tuple[int, ...], graphs: DecodeGraphs | None = None,
                 dispatcher: Dispatcher | None = None, host_pool: HostKVPool | None = None,
                 proposer=None, guided=None, piecewise: PiecewiseGraphs | None = None,
                 tiers=None, lora=None):
        self.model = model
        self.kv = kv
        self.host_pool = host_pool  # swap preemption's host memory (None: swap is off)
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.graphs = graphs
        # Speculative decoding's proposer (actors/speculation/proposers.py), None when it is off.
        self.proposer = proposer
        self.dispatcher = dispatcher or Dispatcher(None, "eager only")
        assert graphs is not None or self.dispatcher.table is None, "a graph table needs graphs"
        self.piecewise = piecewise
        assert piecewise is not None or self.dispatcher.token_table is None, (
            "a token table needs piecewise graphs")
        self._seqs: dict[str, _SeqState] = {}
        # Requests of a step that failed: later batches (already queued when steps overlap)
        # skip them until the scheduler reports them finished.
        self._failed: set[str] = set()
        # Guided decoding (None: no request can carry a constraint).
        self.guided = GuidedMasks(guided, self._seqs, overlap=device.type == "cuda")
        # KV tiers (actors/kv/tiers/manager.TierManager; None: off): blocks copied out of
        # the pool go to it, restored blocks come from the batch.
        self.tiers = tiers
        # The runtime check of a quantized KV cache (kernels/kv_quality_check.py; None: off).
        self.kv_check = None
        # Multi-LoRA serving (actors/execution/lora_cache.LoRACache; None: off).
        self.lora = lora
        # Embeddings: pooling requests' hidden states (actors/execution/pooling.py).
        self.pooler = Pooler()
        # A longrope model: which RoPE rows each sequence's tokens read.
        rope = getattr(model, "rope", None)
        self.long_rope = (LongRope(rope.long_offset, rope.original_max_positions,
                                   lambda rid: self._seqs[rid].long_rope)
                          if getattr(rope, "long_offset", 0) else None)

    def offload(self, offloads: list) -> None:
        """Copy device blocks (block id, BlockMeta, committed) to the KV tiers. A failure
        is logged and costs only the tier copy: the step goes on."""
        if self.tiers is None:
            return
        try:
            t0 = time.perf_counter()
            rows = gather_blocks(self.kv.pool, [b for b, _, _ in offloads], self.kv.scales).numpy()
            self.tiers.offer([m for _, m, _ in offloads], rows, [c for _, _, c in offloads],
                             seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001
            log.error("KV tier offload failed", error=repr(e), blocks=len(offloads))

    def _restore(self, restores: list) -> None:
        t0 = time.perf_counter()
        rows = torch.from_numpy(np.stack([p for _, p in restores]))
        ids = [b for b, _ in restores]
        scatter_blocks(self.kv.pool, ids, rows, self.kv.scales)
        self.kv.refresh_promoted(ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.tiers is not None:
            self.tiers.observe_restore_copy(time.perf_counter() - t0)

    def _begin_kv_check(self, meta) -> None:
        check = self.kv_check
        if check is None:
            return
        if meta.num_decodes:
            check.begin(int(meta.slot_mapping[0]), meta.decode_block_tables[0],
                        int(meta.decode_context_lens[0]))
        else:
            check.begin(None, None, 0)

    def _end_kv_check(self) -> None:
        """Promote the layers the check found over budget (between steps)."""
        check = self.kv_check
        if check is None:
            return
        for layer in check.take_promotions():
            nbytes = self.kv.promote_layer(layer)
            log.warning("KV quality check: layer promoted to the model dtype for new blocks",
                        layer=layer, kl=round(check.stats.last_kl, 5),
                        max_error=round(check.stats.max_error, 4), copy_mib=nbytes / 2**20)

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)

    def _register(self, request_id: str, new: NewSequence) -> None:
        state = self._seqs.get(request_id)
        outputs = list(new.output_token_ids)
        long_rope = (self.long_rope is not None
                     and len(new.prompt_token_ids) + len(outputs) > self.long_rope.original)
        if state is not None:
            state.long_rope = long_rope
            # Resumed after preemption: keep the RNG so seeded output is unchanged, and the
            # grammar state (rebuilt only if the output it followed is not this one).
            state.output_token_ids[:] = outputs
            if state.matcher is not None and state.matcher.num_accepted != len(outputs):
                state.matcher = self.guided.new_matcher(request_id, new.sampling_params,
                                                          outputs)
            return
        p = new.sampling_params
        gen = None if p.is_greedy else make_generator(p.seed, self.device)
        row = SamplingRow(params=p, generator=gen, prompt_token_ids=list(new.prompt_token_ids),
                          output_token_ids=outputs, eos_token_ids=self.eos_token_ids)
        self._seqs[request_id] = _SeqState(row=row, output_token_ids=outputs,
                                           matcher=self.guided.new_matcher(request_id, p, outputs),
                                           long_rope=long_rope)

    def forget(self, request_ids) -> None:
        """These requests have finished: drop their sampling state."""
        for rid in request_ids:
            self._seqs.pop(rid, None)
            self._failed.discard(rid)
            self.pooler.forget(rid)

    def forget_failed(self, batch: ExecuteBatch) -> None:
        """The step raised: drop its requests' state (the scheduler fails them) and skip
        them in batches that were planned before the scheduler heard of it."""
        for s in batch.sequences:
            self._seqs.pop(s.request_id, None)
            self._failed.add(s.request_id)
            self.pooler.forget(s.request_id)

    def _resolve_inputs(self, batch: ExecuteBatch,
                        prev: "LaunchedStep | None") -> tuple[list[int], list[int]]:
        """Drop sequences of failed requests; resolve each PLACEHOLDER to the token its
        request sampled in the previous step (overlapped steps: the scheduler planned this
        step before that token came back). From the host copy when the previous step is
        finished; else (`prev` still on the device) returns (decode rows, rows of
        prev.token_ids) for the forward to copy on the device, with no host round trip."""
        if self._failed:
            keep = [s for s in batch.sequences if s.request_id not in self._failed]
            batch.num_decodes -= sum(s.request_id in self._failed
                                     for s in batch.sequences[:batch.num_decodes])
            batch.sequences = keep
        dst, src = [], []
        for i, s in enumerate(batch.sequences[:batch.num_decodes]):
            if s.token_ids[-1] != PLACEHOLDER:
                continue
            row = prev.row_of.get(s.request_id) if prev is not None else None
            if row is None:
                s.token_ids[-1] = self._seqs[s.request_id].output_token_ids[-1]
            else:
                s.token_ids[-1] = 0   # overwritten on the device before the forward
                dst.append(i)
                src.append(row)
        return dst, src

    def can_launch_ahead(self, batch: ExecuteBatch) -> bool:
        """Whether `batch` may be launched before the previous step's tokens reach the
        host: only when none of its sampled rows reads its output history on the host."""
        for s in batch.sequences:
            if s.num_draft or s.propose:   # verification and proposals read host history
                return False
            if not s.sample:
                continue
            state = self._seqs.get(s.request_id)
            params = s.new.sampling_params if s.new is not None else (
                state.row.params if state is not None else None)
            if params is None or reads_host_history(params):
                return False
        return True

    def execute(self, batch: ExecuteBatch) -> StepOutput:
        """Run one step to the end (launch, then finish)."""
        return self.finish(self.launch(batch))

    def launch(self, batch: ExecuteBatch, prev: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Everything up to the sampled token ids, left on the device (on CUDA the kernels
        are queued, nothing waits for them). `prev`: the previous step when it has been
        launched but not finished; its tokens feed this step's placeholders on the device."""
        t0 = time.perf_counter()
        self.forget(batch.finished_ids)
        for s in batch.sequences:
            if s.new is not None:
                self._register(s.request_id, s.new)
        patch = self._resolve_inputs(batch, prev)
        # KV tiers: evicted blocks leave before anything below may overwrite them.
        if batch.kv_offloads:
            self.offload(batch.kv_offloads)
        # In the order the KV manager decided them within the step's one update: the swap
        # victims' blocks are read out first (then freed), a fork's copy-on-write may land in
        # one of them, and swap-ins refill blocks granted after both.
        swap_seconds = 0.0
        # A draft model's KV moves with the target's (actors/speculation/draft_model.py).
        draft = self.proposer if getattr(self.proposer, "host_pool", None) else None
        t_swap = time.perf_counter()
        if batch.swap_out:  # swap preemption, before anything reuses the blocks
            self.host_pool.swap_out(self.kv, batch.swap_out)
            if draft is not None:
                draft.swap_out(batch.swap_out)
        if batch.block_copies:  # copy-on-write of forked siblings' partial blocks
            self.kv.copy_blocks(batch.block_copies)
            if hasattr(self.proposer, "copy_blocks"):
                self.proposer.copy_blocks(batch.block_copies)
        if batch.swap_in:
            self.host_pool.swap_in(self.kv, batch.swap_in)
            if draft is not None:
                draft.swap_in(batch.swap_in)
        if batch.swap_out or batch.swap_in:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            swap_seconds = time.perf_counter() - t_swap
        if batch.kv_restores:   # KV tiers: restored blocks, into blocks granted this step
            self._restore(batch.kv_restores)
        if self.lora is not None:
            for slot, name, path in batch.lora_loads:   # adapters into the slots assigned
                self.lora.load(slot, name, path)
            self.lora.check(batch.sequences)
        launched = LaunchedStep(batch=batch, t0=t0, swap_seconds=swap_seconds)
        if not batch.sequences:
            return launched
        patch_src = None
        if patch[0]:
            patch_src = (torch.tensor(patch[0], dtype=torch.int64, device=self.device),
                         prev.token_ids[torch.tensor(patch[1], dtype=torch.int64,
                                                     device=self.device)])
        drafts = {s.request_id: s.token_ids[len(s.token_ids) - s.num_draft:]
                  for s in batch.sequences if s.num_draft}
        masks = self.guided
        guided = masks.start(batch, drafts) if masks.overlap else None
        try:
            logits, sample_ids, launched.prompt = self._forward(batch, patch_src)  # [S, V]
        finally:   # (a failed step still waits: nothing else may touch a matcher meanwhile)
            fill = guided[1].result() if guided is not None else None
        launched.pooled = self.pooler.take()
        if fill is not None:
            assert sample_ids == guided[0], "guided masks filled for other rows"
            logits = masks.mask(logits, fill)
        elif masks.compiler is not None and sample_ids and not masks.overlap:
            logits = masks.apply(logits, sample_ids, drafts)
        if sample_ids and drafts:
            launched.sample_ids = list(dict.fromkeys(sample_ids))     # each request once
            launched.emitted = self._sample_speculative(batch, logits, sample_ids, drafts)
        elif sample_ids:
            rows = [self._seqs[rid].row for rid in sample_ids]
            launched.sample_ids = sample_ids
            launched.row_of = {rid: i for i, rid in enumerate(sample_ids)}
            if any(r.params.logprobs is not None for r in rows):
                launched.samples = sample(logits, rows)               # host values now
            else:
                launched.token_ids = sample_ids_on_device(logits, rows)  # [S]
            if self.device.type == "cuda":
                launched.event = torch.cuda.Event()
                launched.event.record()
        return launched

    def finish(self, launched: "LaunchedStep") -> StepOutput:
        """Bring the step's tokens to the host (on CUDA, waits for its kernels) and record
        them in each request's sampling state."""
        batch = launched.batch
        emitted = launched.emitted
        if emitted is None:
            samples = launched.samples
            if samples is None and launched.token_ids is not None:
                samples = [Sample(t, None, None) for t in launched.token_ids.tolist()]
            emitted = {rid: [tok] for rid, tok in zip(launched.sample_ids, samples or ())}
        sampled: list[SampledToken] = []
        for rid in launched.sample_ids:
            state = self._seqs.get(rid)
            if state is None or rid in self._failed:
                continue  # its request ended (or failed) while this step was on the device
            for tok in emitted.get(rid, ()):
                matcher = state.matcher
                if matcher is not None and matcher.terminated and matcher.error is None:
                    break   # sampled after its EOS, in a step planned before it: not output
                if matcher is not None and (matcher.error is not None
                                            or not matcher.accept(tok.token_id)):
                    error = matcher.error or no_token_error(state.row.params)
                    sampled.append(SampledToken(request_id=rid, token_id=tok.token_id,
                                                error=error))
                    self._seqs.pop(rid, None)
                    self._failed.add(rid)   # until the scheduler reports it finished
                    break
                state.output_token_ids.append(tok.token_id)
                lp = None
                if tok.logprob is not None:
                    lp = TokenLogprob(token_id=tok.token_id, logprob=tok.logprob,
                                      top=tok.top_logprobs)
                sampled.append(SampledToken(request_id=rid, token_id=tok.token_id, logprob=lp))
        spec, draft_seconds = self._speculation(batch, launched.emitted)
        prompt = launched.prompt
        if launched.pooled:
            launched.pooled_outputs = self.pooler.messages(launched.pooled)
        return StepOutput(step=batch.step, sampled=sampled,
                          compute_seconds=time.perf_counter() - launched.t0,
                          swap_seconds=launched.swap_seconds, spec=spec,
                          draft_seconds=draft_seconds,
                          prompt_logprobs=prompt_logprobs.to_messages(*prompt) if prompt else [])

    def _sample_speculative(self, batch: ExecuteBatch, logits: torch.Tensor,
                            sample_ids: list[str],
                            drafts: dict[str, list[int]]) -> dict[str, list[Sample]]:
        """A step with drafts to verify: plain rows sample as usual; each speculative
        sequence's rows go through the rejection rule (kernels/spec_verify.py): its first
        len(drafts[rid]) + 1 of the num_draft + 1 computed (fewer when a grammar cut the
        proposal)."""
        spans = {s.request_id: s.num_draft + 1 for s in batch.sequences if s.num_draft}
        plain_rows, plain_ids, proposals, spec_rows, spec_ids = [], [], [], [], []
        i = 0
        while i < len(sample_ids):
            rid = sample_ids[i]
            state = self._seqs[rid]
            d = drafts.get(rid)
            if d is None:
                plain_rows.append(i)
                plain_ids.append(rid)
                i += 1
                continue
            probs = state.draft_probs
            state.draft_probs = None
            if probs is not None:
                probs = probs[: len(d)]
            proposals.append(Proposal(expand_rows(state.row, d), d, probs))
            spec_rows.extend(range(i, i + len(d) + 1))
            spec_ids.append(rid)
            i += spans[rid]
        out: dict[str, list[Sample]] = {}
        if plain_rows:
            index = torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)
            for rid, tok in zip(plain_ids, sample(logits[index],
                                                  [self._seqs[r].row for r in plain_ids])):
                out[rid] = [tok]
        index = torch.tensor(spec_rows, dtype=torch.int64, device=logits.device)
        for rid, toks in zip(spec_ids, verify(logits[index], proposals)):
            out[rid] = toks
        return out

    def _speculation(self, batch: ExecuteBatch,
                     emitted: dict[str, list[Sample]] | None) -> tuple[list[SpecResult], float]:
        """Each speculative sequence's acceptance, and the proposals asked for (after the
        step's tokens are in the history they extend)."""
        results: dict[str, SpecResult] = {}
        for s in batch.sequences:
            if s.num_draft and emitted is not None and s.request_id in emitted:
                results[s.request_id] = SpecResult(
                    request_id=s.request_id, num_draft=s.num_draft,
                    num_accepted=len(emitted[s.request_id]) - 1)
        wanted = [s for s in batch.sequences if s.propose and s.sample
                  and s.request_id in self._seqs and s.request_id not in self._failed]
        draft_seconds = 0.0
        if wanted and self.proposer is not None:
            t0 = time.perf_counter()
            states = [self._seqs[s.request_id] for s in wanted]
            for s, state, (tokens, probs) in zip(wanted, states,
                                                 self.proposer.propose(wanted, states)):
                if state.matcher is not None:   # drafts the grammar refuses: not verified
                    tokens = tokens[:state.matcher.legal_prefix(tokens)]
                state.draft_probs = probs
                r = results.setdefault(s.request_id, SpecResult(request_id=s.request_id))
                r.proposals = tokens
            draft_seconds = time.perf_counter() - t0
        return list(results.values()), draft_seconds

    def _reference_decode(self) -> bool:
        # Only the torch reference decode reads a precomputed mask; kernels do without.
        return self.model.layers[0].self_attn.decode_fn is None

    def forward_logits(self, batch: ExecuteBatch) -> torch.Tensor:
        """The raw logits of a batch's sampled rows (for parity tests and debugging)."""
        return self._forward(batch, None)[0].clone()


    def num_promoted_layers(self) -> int:
        """Layers promoted to full precision so far (as kv_quant_stats counts them)."""
        check = self.kv_check
        return len(self.kv.promoted_layers()) if check is None else len(check.stats.promoted)

    def kv_quant_stats(self, kv_dtype: str, bytes_per_token: int,
                       rotation: str = "none") -> KVQuantStats:
        check = self.kv_check
        if check is None:
            return KVQuantStats(kv_dtype=kv_dtype, bytes_per_token=bytes_per_token,
                                rotation=rotation,
                                promoted_layers=self.kv.promoted_layers(),
                                num_promoted_layers=len(self.kv.promoted_layers()))
        s = check.stats
        return KVQuantStats(kv_dtype=kv_dtype, bytes_per_token=bytes_per_token,
                            rotation=rotation, check_fraction=check.fraction, check_steps=s.checks,
                            check_layer_comparisons=s.layer_checks, check_alarms=s.alarms,
                            check_max_kl=s.max_kl, check_last_kl=s.last_kl,
                            check_max_error=s.max_error, promoted_layers=list(s.promoted),
                            num_promoted_layers=len(s.promoted))

    def lora_stats(self):
        """A copy of the adapter-load counters (None: [lora] off)."""
        return None if self.lora is None else msgspec.structs.replace(self.lora.stats)

    def graph_stats(self) -> GraphStats:
        stats = self.dispatcher.stats()
        if self.graphs is not None:
            stats.update(captured_sizes=list(self.graphs.sizes),
                         capture_seconds=self.graphs.capture_seconds,
                         capture_bytes=self.graphs.capture_bytes,
                         replays=self.graphs.num_replays,
                         static_eager_runs=self.graphs.num_static_eager)
        if self.piecewise is not None:
            stats.update(piecewise_captured_sizes=list(self.piecewise.sizes),
                         piecewise_capture_seconds=self.piecewise.capture_seconds,
                         piecewise_capture_bytes=self.piecewise.capture_bytes,
                         piecewise_replays=self.piecewise.num_replays,
                         piecewise_static_eager_runs=self.piecewise.num_static_eager)
        return GraphStats(**stats)

    def _forward(self, batch: ExecuteBatch, patch) -> tuple[torch.Tensor, list[str], tuple | None]:
        """Logits of the rows to sample [S, vocab], their request ids, and the prompt
        logprobs of the chunks that asked for them ((rows, device values) or None). `patch`:
        None, or (decode rows, token ids on the device) to write into the input ids first.

        A step with prompt-logprob chunks runs the path it would have run anyway (piecewise
        or eager: a decode graph holds no prefill) and sends the extra rows of its residual
        stream through the LM head afterwards (prompt_logprobs.py)."""
        seqs = batch.sequences
        num_tokens = sum(len(s.token_ids) for s in seqs)
        decision = self.dispatcher.dispatch(len(seqs), batch.num_decodes, num_tokens)
        mirror = getattr(self.proposer, "mirror", None)  # a draft model follows every forward
        if decision.mode == GRAPH:
            logits = self.graphs.run(seqs, decision.padded_size, patch)  # [padded, vocab]
            if mirror is not None:
                inputs = build_batch_inputs(batch, self.kv.block_size, self.device,
                                            with_decode_mask=self._reference_decode(),
                                            long_rope=self.long_rope)
                if patch is not None:
                    inputs.input_ids.index_copy_(0, patch[0], patch[1])
                mirror(inputs)
            rows = [i for i, s in enumerate(seqs) if s.sample]
            sample_ids = [seqs[i].request_id for i in rows]
            if len(rows) == len(seqs):          # every decode samples: a view, no copy
                return logits[: len(seqs)], sample_ids, None
            index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            return logits[index], sample_ids, None
        inputs = build_batch_inputs(batch, self.kv.block_size, self.device,
                                    with_decode_mask=self._reference_decode(),
                                    long_rope=self.long_rope)
        if patch is not None:   # decodes come first in the flat batch: row i is token i
            inputs.input_ids.index_copy_(0, patch[0], patch[1])
        # (piecewise: h is a view of the static buffer, used before the next step)
        if decision.mode == PIECEWISE:
            h = self.piecewise.run_hidden(inputs.input_ids, inputs.positions, inputs.meta,
                                          decision.padded_size)
        else:
            self._begin_kv_check(inputs.meta)
            h = self.model.forward_hidden(inputs.input_ids, inputs.positions, self.kv,
                                          inputs.meta)
            self._end_kv_check()
        with torch.inference_mode():
            logits = self.model.logits(h, inputs.logits_indices)
        plan = prompt_logprobs.plan_rows(batch, self._seqs, self.device)
        prompt = None if plan is None else (plan, prompt_logprobs.compute(self.model, h, plan))
        self.pooler.collect(self.model, h, batch, self._seqs)
        if mirror is not None:
            mirror(inputs)
        return logits, inputs.sample_ids, prompt

