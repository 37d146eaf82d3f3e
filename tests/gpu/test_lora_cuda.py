"""CUDA-only checks of multi-LoRA serving (run by `make gpu-check`; skipped here with the
reason where no CUDA GPU exists). Random models and random adapter weights (the GPU host has
no network):
1. the Triton BGMV kernel equals the torch reference on CUDA, fp32 and bf16, rows of several
   slots and base rows in one launch, at the default model's projection shapes;
2. decode CUDA graphs captured with LoRA (every slot, per-row slots in the static buffers)
   replay to the eager forward's logits for a batch mixing three adapters and base rows,
   and the adapters change the logits (the check could fail);
3. the step time of a graph with 16 rows over 4 adapters against the same graph's base rows
   is printed (the GPU check's record; no timing assert).
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from tokenloom.arith import cdiv

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (none here); run `make gpu-check` on a GPU host"),
]

BS = 16


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_triton_lora_kernel_matches_reference(dtype, tol):
    from tokenloom.kernels.gpu.triton_lora import lora_add_reference, lora_add_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    for k, n, rank in [(576, 960, 48), (576, 3072, 32), (1536, 576, 16)]:
        slots = torch.tensor([0, -1, 3, 3, 1, -1, 2, 0] * 4, device="cuda")
        x = torch.randn(len(slots), k, device="cuda", generator=g).to(dtype)
        a = (torch.randn(4 * rank, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
        bt = (torch.randn(4 * rank, n, device="cuda", generator=g) / rank ** 0.5).to(dtype)
        out = torch.randn(len(slots), n, device="cuda", generator=g).to(dtype)
        ref = lora_add_reference(out.clone(), x, a, bt.T, slots, rank)
        got = lora_add_triton(out.clone(), x, a, bt.T, slots, rank)
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        assert torch.equal(got[1], out[1])


def _random_adapter(spec, rank: int, seed: int):
    from tokenloom.kernels.lora.peft_adapter import LoRAWeights, fused_shapes

    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(spec.num_layers):
        pairs = {}
        for kind, (fan_in, fan_out, subs) in fused_shapes(spec).items():
            u = rank * subs
            pairs[kind] = (torch.randn(u, fan_in, generator=g) / fan_in ** 0.5,
                           torch.randn(fan_out, u, generator=g) / u ** 0.5)
        layers.append(pairs)
    return LoRAWeights(f"r{seed}", "", rank, 16.0, False, (), layers)


def _setup(shape: str, dtype, sizes, max_context: int = 256):
    from tokenloom.graphs.buffers import DecodeBuffers
    from tokenloom.graphs.capture import DecodeGraphs
    from tokenloom.kernels.gpu.triton_attention import make_decode_kernel, store_kv_triton
    from tokenloom.kernels.gpu.triton_lora import lora_add_triton
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.lora.stacks import LoRAStacks
    from tokenloom.kernels.models.random_model import SHAPES, random_model

    spec = SHAPES[shape]
    model = random_model(spec, dtype, "cuda", max_positions=max_context + BS, seed=0)
    model.set_decode_kernel(make_decode_kernel(spec))
    model.set_kv_store_kernel(store_kv_triton)
    stacks = LoRAStacks(spec, 4, 8, dtype, "cuda")
    for slot in range(3):
        stacks.load(slot, _random_adapter(spec, 8, seed=slot))
    model.enable_lora(stacks, lora_add_triton)
    blocks_per_seq = cdiv(max_context, BS)
    kv = KVCache.allocate(spec.num_layers, max(sizes) * blocks_per_seq + 1, BS,
                          spec.num_kv_heads, spec.head_dim, dtype, "cuda")
    buffers = DecodeBuffers(max(sizes), blocks_per_seq, BS, spec.vocab_size, "cuda")
    buffers.lora = True
    return spec, model, kv, DecodeGraphs(model, kv, buffers), blocks_per_seq


def _seqs(n, blocks_per_seq, vocab, slots, rng):
    out = []
    for i in range(n):
        pos = rng.randrange(0, 200)
        out.append(SimpleNamespace(request_id=f"r{i}", token_ids=[rng.randrange(vocab)],
                                   start_pos=pos, sample=True, lora_slot=slots[i % len(slots)],
                                   block_table=[1 + i * blocks_per_seq + j
                                                for j in range(pos // BS + 1)]))
    return out


def test_decode_graphs_replay_lora_rows():
    from tokenloom.actors.execution.batch_inputs import build_batch_inputs

    sizes = (8, 16)
    spec, model, kv, graphs, bps = _setup("smollm2-135m", torch.bfloat16, sizes)
    graphs.capture(sizes, memory_budget_bytes=8 << 30, progress=False)
    seqs = _seqs(12, bps, spec.vocab_size, [0, -1, 1, 2], random.Random(0))
    batch = SimpleNamespace(sequences=seqs, num_decodes=len(seqs))
    inputs = build_batch_inputs(batch, BS, torch.device("cuda"))
    with torch.inference_mode():
        eager = model(inputs.input_ids, inputs.positions, kv, inputs.meta,
                      inputs.logits_indices)
        inputs.meta.lora = None
        base = model(inputs.input_ids, inputs.positions, kv, inputs.meta,
                     inputs.logits_indices)
    replay = graphs.run(seqs, 16)[: len(seqs)].clone()
    assert graphs.num_replays == 1
    torch.testing.assert_close(replay, eager, atol=5e-2, rtol=5e-2)
    adapter_rows = [i for i, s in enumerate(seqs) if s.lora_slot >= 0]
    assert (eager[adapter_rows] - base[adapter_rows]).abs().max() > 0.1
    base_rows = [i for i, s in enumerate(seqs) if s.lora_slot < 0]
    torch.testing.assert_close(eager[base_rows], base[base_rows], atol=5e-2, rtol=5e-2)

    def step(slots):
        seqs = _seqs(16, bps, spec.vocab_size, slots, random.Random(1))
        for _ in range(3):
            graphs.run(seqs, 16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            graphs.run(seqs, 16)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 50
    base_s, lora_s = step([-1]), step([0, 1, 2, -1])
    print(f"\nLoRA decode graph, 16 rows (smollm2-135m bf16): base rows {1e3 * base_s:.3f} ms, "
          f"3 adapters + base {1e3 * lora_s:.3f} ms ({lora_s / base_s:.2f}x)")
