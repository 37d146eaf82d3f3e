"""The graph path's LoRA rows on CPU: DecodeBuffers carries each row's slot (padding -1), and
the static-buffer forward (what a CUDA graph captures; `DecodeGraphs.run` runs it eagerly on
CPU) gives the eager forward's logits for a batch mixing adapters and base rows, padded to a
larger bucket. The adapters change the logits, so the check can fail."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from tokenloom.actors.execution.batch_inputs import build_batch_inputs
from tokenloom.arith import cdiv
from tokenloom.graphs.buffers import DecodeBuffers
from tokenloom.graphs.capture import DecodeGraphs
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.lora.peft_adapter import LoRAWeights, fused_shapes
from tokenloom.kernels.lora.stacks import LoRAStacks
from tokenloom.kernels.models.random_model import SHAPES, random_model

BS = 16


def _adapter(spec, rank, seed):
    g = torch.Generator().manual_seed(seed)
    layers = [{kind: (torch.randn(rank * subs, fan_in, generator=g) / fan_in ** 0.5,
                      torch.randn(fan_out, rank * subs, generator=g))
               for kind, (fan_in, fan_out, subs) in fused_shapes(spec).items()}
              for _ in range(spec.num_layers)]
    return LoRAWeights(f"r{seed}", "", rank, 16.0, False, (), layers)


def test_static_buffers_carry_lora_slots():
    spec = SHAPES["tiny"]
    model = random_model(spec, torch.float32, "cpu", max_positions=256)
    stacks = LoRAStacks(spec, 3, 4, torch.float32, "cpu")
    stacks.load(0, _adapter(spec, 4, 1))
    stacks.load(2, _adapter(spec, 2, 2))
    model.enable_lora(stacks)
    bps = cdiv(128, BS)
    kv = KVCache.allocate(spec.num_layers, 8 * bps + 1, BS, spec.num_kv_heads, spec.head_dim,
                          torch.float32, "cpu")
    for k, v in zip(kv.key, kv.value):
        k.normal_()
        v.normal_()
    buffers = DecodeBuffers(8, bps, BS, spec.vocab_size, "cpu")
    buffers.lora = True
    graphs = DecodeGraphs(model, kv, buffers)
    rng = random.Random(0)
    slots = [0, -1, 2, 0, -1]
    seqs = []
    for i, slot in enumerate(slots):
        pos = rng.randrange(0, 100)
        seqs.append(SimpleNamespace(request_id=f"r{i}", token_ids=[rng.randrange(3, 250)],
                                    start_pos=pos, sample=True, lora_slot=slot,
                                    block_table=[1 + i * bps + j for j in range(pos // BS + 1)]))
    inputs = build_batch_inputs(SimpleNamespace(sequences=seqs, num_decodes=len(seqs)), BS,
                                torch.device("cpu"))
    with torch.inference_mode():
        eager = model(inputs.input_ids, inputs.positions, kv, inputs.meta,
                      inputs.logits_indices)
        inputs.meta.lora = None
        base = model(inputs.input_ids, inputs.positions, kv, inputs.meta,
                     inputs.logits_indices)
    static = graphs.run(seqs, 8)[: len(seqs)]
    assert buffers.lora_slots[:8].tolist() == slots + [-1, -1, -1]
    torch.testing.assert_close(static, eager, atol=1e-4, rtol=1e-4)
    assert (eager[[0, 2, 3]] - base[[0, 2, 3]]).abs().max() > 1e-2
    torch.testing.assert_close(eager[[1, 4]], base[[1, 4]])
