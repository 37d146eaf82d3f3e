"""The draft-model proposer: a smaller model sharing the tokenizer guesses k tokens.

It keeps its own KV cache, indexed by the target's block tables (same block ids, same
block size; a draft block is small): every forward the target runs is mirrored by the
draft over the same flat batch (`mirror`), so the draft's KV holds exactly the positions
the target has computed, with the same tokens — prefix-cache hits included, since a
cached block was mirrored when it was first computed. Proposals then take k one-token
decode steps from the newest token, writing draft KV at the positions after it; the
scheduler grants those slots (speculative `lookahead`). Rejected proposals' draft KV is
overwritten when the real tokens are mirrored.

Greedy requests take the draft's argmax (the verification compares argmaxes); sampled
ones draw from the draft's temperature-scaled distribution q, kept for the rejection rule.
Swap preemption moves the draft's KV with the target's (`enable_swap`: a host pool of the
same slots, in the draft's smaller block size), so a swapped-in request proposes as well
as before it was preempted.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.actors.execution.batch_inputs import BatchInputs, build_batch_inputs
from tokenloom.actors.messages import ExecuteBatch, ScheduledSequence
from tokenloom.arith import cdiv
from tokenloom.kernels.kv_store import HostKVPool, KVCache
from tokenloom.kernels.sampling import argmax_rows


class DraftModelProposer:
    def __init__(self, model, kv: KVCache, device: torch.device):
        self.model = model
        self.kv = kv
        self.device = device
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)
        self.host_pool: HostKVPool | None = None   # swap preemption (enable_swap)

    @classmethod
    def load(cls, name: str, cache_dir: Path, info, attention_backend: str, *,
             max_num_seqs: int):
        """Load the draft model named in config (a directory or "default") on the target's
        device and dtype, with a KV cache of the target's block geometry (on CUDA, every
        decode-kernel variant for up to `max_num_seqs` rows compiled now)."""
        from tokenloom.config.schema import ConfigError
        from tokenloom.kernels.device import select_decode_backend
        from tokenloom.kernels.models.loader import load_model, load_spec, resolve_model_dir
        model_dir = resolve_model_dir(name, cache_dir)
        spec = load_spec(model_dir)
        if spec.vocab_size != info.spec.vocab_size:
            raise ConfigError(f"speculative.draft_model {name!r} has a vocabulary of "
                              f"{spec.vocab_size} tokens but the model has "
                              f"{info.spec.vocab_size}: a draft must share the tokenizer",
                              key="speculative.draft_model")
        device, dtype = info.torch_device, info.torch_dtype
        model, spec = load_model(model_dir, dtype, device,
                                 max_positions=info.max_model_len)
        select_decode_backend(model, attention_backend, device,
                              max_model_len=info.max_model_len, block_size=info.block_size)
        kv = KVCache.allocate(spec.num_layers, info.num_blocks, info.block_size,
                              spec.num_kv_heads, spec.head_dim, dtype, device)
        from tokenloom.graphs.setup import precompile_decode   # no-op unless the Triton split
        width = cdiv(info.max_model_len, info.block_size) * info.block_size
        precompile_decode(model, kv, max_num_seqs=max_num_seqs, width=width, graph_sizes=())
        return cls(model, kv, device)

    def _reference_decode(self) -> bool:
        return self.model.layers[0].self_attn.decode_fn is None

    @torch.inference_mode()
    def mirror(self, inputs: BatchInputs) -> None:
        """Compute the draft's KV for the positions the target computes in this batch."""
        self.model(inputs.input_ids, inputs.positions, self.kv, inputs.meta, self._empty)

    def copy_blocks(self, pairs) -> None:
        """Copy-on-write of forked siblings' partial blocks, as the target's KV does."""
        self.kv.copy_blocks(pairs)

    def enable_swap(self, num_slots: int) -> int:
        """Keep a host slot per target swap slot; returns its host bytes."""
        self.host_pool = HostKVPool(self.kv.pool, num_slots)
        return self.host_pool.data.numel() * self.host_pool.data.element_size()

    def swap_out(self, pairs) -> None:
        """The target's swap-out, for the draft's KV: pairs of (block, slot)."""
        self.host_pool.swap_out(self.kv, pairs)

    def swap_in(self, pairs) -> None:
        """The target's swap-in, for the draft's KV: pairs of (slot, block)."""
        self.host_pool.swap_in(self.kv, pairs)

    @torch.inference_mode()
    def propose(self, seqs, states):
        """k draft tokens per sequence from its newest token, batched one position at a
        time; fewer where its block table has no slot for them."""
        block_size = self.kv.block_size
        live = []
        for s, state in zip(seqs, states):
            pos = len(state.row.prompt_token_ids) + len(state.output_token_ids) - 1
            room = len(s.block_table) * block_size - pos
            live.append((s, state, pos, max(0, min(s.propose, room))))
        tokens = {id(s): [] for s, _, _, _ in live}
        probs = {id(s): [] for s, _, _, _ in live}
        last = {id(s): state.output_token_ids[-1] for s, state, _, _ in live}
        for i in range(max((n for *_, n in live), default=0)):
            active = [(s, state, pos) for s, state, pos, n in live if n > i]
            batch = ExecuteBatch(step=0, num_decodes=len(active), sequences=[
                ScheduledSequence(request_id=s.request_id, token_ids=[last[id(s)]],
                                  start_pos=pos + i, block_table=s.block_table, sample=True)
                for s, _, pos in active])
            inputs = build_batch_inputs(batch, block_size, self.device,
                                        with_decode_mask=self._reference_decode())
            logits = self.model(inputs.input_ids, inputs.positions, self.kv, inputs.meta,
                                inputs.logits_indices)                  # [A, vocab]
            greedy = argmax_rows(logits).tolist()
            for row, (s, state, _) in enumerate(active):
                params = state.row.params
                if params.is_greedy:
                    tok = greedy[row]
                else:
                    q = (logits[row].float() / params.temperature).softmax(-1)
                    tok = int(torch.multinomial(q, 1, generator=state.row.generator))
                    probs[id(s)].append(q)
                tokens[id(s)].append(tok)
                last[id(s)] = tok
        out = []
        for s, state, _, _ in live:
            p = probs[id(s)]
            out.append((tokens[id(s)], torch.stack(p) if p else None))
        return out
