"""LoRA deltas in our forward against transformers + PEFT on the same random adapters.

1. One step mixing rows of two adapters (different ranks and targets, one rsLoRA) and base
   rows, prefill and decode, matches PEFT's logits for each row's own adapter.
2. The static (all slots, masked) path gives the same logits as the grouped eager path.
3. Reloading a slot with another adapter leaves nothing of the first behind.
4. A bad adapter fails with a message naming it and the problem.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenloom.actors.execution.batch_inputs import build_batch_inputs
from tokenloom.actors.messages import ExecuteBatch, ScheduledSequence
from tokenloom.arith import cdiv
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.lora.peft_adapter import LoRAAdapterError, load_adapter
from tokenloom.kernels.lora.stacks import LoRABatch, LoRAStacks
from tokenloom.kernels.models.loader import load_model, load_spec

from tinymodel import build_random_adapter, build_tiny_model, peft_oracle

BS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    build_tiny_model(base, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=11)
    a = build_random_adapter(base, root / "a", rank=8, seed=1)
    b = build_random_adapter(base, root / "b", rank=4, seed=2, targets=("q_proj", "v_proj",
                                                                         "down_proj"),
                             use_rslora=True, alpha=8.0)
    return base, a, b


def _seq(rid, ids, start, table, slot):
    return ScheduledSequence(request_id=rid, token_ids=ids, start_pos=start,
                             block_table=table[:cdiv(start + len(ids), BS)], sample=True,
                             lora_slot=slot)


def _oracle_logits(base, adapter, ids):
    with torch.no_grad():
        return peft_oracle(base, adapter)(torch.tensor([ids])).logits[0, -1].float()


def test_mixed_batch_matches_peft(setup):
    base, dir_a, dir_b = setup
    spec = load_spec(base)
    model, _ = load_model(base, torch.float32, torch.device("cpu"), 256)
    stacks = LoRAStacks(spec, max_loras=3, max_rank=8, dtype=torch.float32, device="cpu")
    stacks.load(2, load_adapter("a", dir_a, spec, max_rank=8))
    stacks.load(0, load_adapter("b", dir_b, spec, max_rank=8))
    model.enable_lora(stacks)
    kv = KVCache.allocate(spec.num_layers, 64, BS, spec.num_kv_heads, spec.head_dim,
                          torch.float32, "cpu")
    prompts = {"a": [5, 9, 44, 17, 3, 99, 120, 7, 8, 61, 33], "base": [5, 9, 44, 17, 200],
               "b": [12, 250, 31, 77, 4, 4, 19, 90, 100]}
    slots = {"a": 2, "base": -1, "b": 0}
    dirs = {"a": dir_a, "base": None, "b": dir_b}
    tables = {"a": list(range(0, 8)), "base": list(range(8, 16)), "b": list(range(16, 24))}
    seqs = [_seq(r, p, 0, tables[r], slots[r]) for r, p in prompts.items()]
    batch = ExecuteBatch(step=0, sequences=seqs, num_decodes=0)
    inputs = build_batch_inputs(batch, BS, torch.device("cpu"))
    assert inputs.meta.lora is not None and inputs.meta.lora.span == (0, 3)
    out = model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.logits_indices)
    nxt = {}
    for i, rid in enumerate(prompts):
        want = _oracle_logits(base, dirs[rid], prompts[rid])
        diff = (out[i] - want).abs().max().item()
        assert diff < 1e-4, f"{rid}: prefill logits differ from PEFT by {diff}"
        nxt[rid] = int(out[i].argmax())
    # The adapters change the output (else the test could not fail).
    base_logits = _oracle_logits(base, None, prompts["a"])
    assert (base_logits - out[0]).abs().max() > 1e-2

    # Decode step: each row one token, mixed slots.
    seqs = [_seq(r, [nxt[r]], len(p), tables[r], slots[r]) for r, p in prompts.items()]
    batch = ExecuteBatch(step=1, sequences=seqs, num_decodes=3)
    inputs = build_batch_inputs(batch, BS, torch.device("cpu"))
    out = model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.logits_indices)
    for i, rid in enumerate(prompts):
        want = _oracle_logits(base, dirs[rid], prompts[rid] + [nxt[rid]])
        diff = (out[i] - want).abs().max().item()
        assert diff < 1e-4, f"{rid}: decode logits differ from PEFT by {diff}"

    # The static path (every slot, masked per row) gives the same logits.
    static = LoRABatch(token_slots=inputs.meta.lora.token_slots, groups=None)
    inputs.meta.lora = static
    again = model(inputs.input_ids, inputs.positions, kv, inputs.meta, inputs.logits_indices)
    assert (again - out).abs().max().item() < 1e-4


def test_reloading_a_slot_leaves_nothing_behind(setup):
    base, dir_a, dir_b = setup
    spec = load_spec(base)
    fresh = LoRAStacks(spec, 2, 8, torch.float32, "cpu")
    fresh.load(1, load_adapter("b", dir_b, spec, 8))
    reused = LoRAStacks(spec, 2, 8, torch.float32, "cpu")
    reused.load(1, load_adapter("a", dir_a, spec, 8))
    reused.load(1, load_adapter("b", dir_b, spec, 8))
    for kind in fresh.a:
        assert torch.equal(fresh.a[kind], reused.a[kind]), kind
        assert torch.equal(fresh.bt[kind], reused.bt[kind]), kind
        assert fresh.used[kind] == reused.used[kind]
    reused.clear(1)
    assert all(not t.any() for t in reused.a.values())


def test_bad_adapters_name_the_problem(setup, tmp_path):
    base, dir_a, _ = setup
    spec = load_spec(base)
    with pytest.raises(LoRAAdapterError, match="'x'.*rank 8.*max_lora_rank = 4"):
        load_adapter("x", dir_a, spec, max_rank=4)
    with pytest.raises(LoRAAdapterError, match="'x'.*not a directory"):
        load_adapter("x", tmp_path / "nowhere", spec, 8)
    bad = tmp_path / "bad"
    shutil.copytree(dir_a, bad)
    (bad / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors is missing"):
        load_adapter("x", bad, spec, 8)
    shutil.rmtree(bad)
    shutil.copytree(dir_a, bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoRAAdapterError, match="use_dora"):
        load_adapter("x", bad, spec, 8)
    # An adapter for another base model: the shapes do not fit.
    other = tmp_path / "other-base"
    build_tiny_model(other, "LlamaConfig", dict(num_hidden_layers=2, hidden_size=32,
                                                tie_word_embeddings=True), seed=3)
    wrong = build_random_adapter(other, tmp_path / "wrong", rank=4, seed=5)
    with pytest.raises(LoRAAdapterError, match="another base model"):
        load_adapter("x", wrong, spec, 8)
