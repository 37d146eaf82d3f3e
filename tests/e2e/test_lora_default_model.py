"""Multi-LoRA on the real default model (SmolLM2-135M-Instruct, fp32, CPU) against
transformers + PEFT: a random rank-8 adapter on every projection and a rank-4 one on
q/v only, mixed with base-model requests in one batch, with chunked prefill and with the
second adapter waiting for the only device slot. Greedy output equals PEFT's per adapter.
"""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams

from tinymodel import build_random_adapter, peft_oracle

pytestmark = pytest.mark.slow

MAX_NEW = 16
PROMPTS = [
    "The capital of France is",
    "List three uses of copper:\n1.",
    "Q: If a train travels 60 km in 45 minutes, what is its speed in km/h?\nA:",
    "Once upon a time, in a village at the edge of a vast forest,",
]
ADAPTERS = ["r8", None, "r4", "r8"]


@pytest.fixture(scope="module")
def world(default_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lora-default")
    dirs = {"r8": build_random_adapter(default_model_dir, root / "r8", rank=8, seed=1,
                                       scale=0.5),
            "r4": build_random_adapter(default_model_dir, root / "r4", rank=4, seed=2,
                                       targets=("q_proj", "v_proj"), scale=1.0)}
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    expected = []
    for p, name in zip(ids, ADAPTERS):
        model = peft_oracle(default_model_dir, dirs[name] if name else None)
        with torch.inference_mode():
            g = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                               attention_mask=torch.ones(1, len(p), dtype=torch.long))
        expected.append(g[0, len(p):].tolist())
    base = peft_oracle(default_model_dir, None)
    with torch.inference_mode():
        g = base.generate(torch.tensor([ids[0]]), max_new_tokens=MAX_NEW, do_sample=False,
                          attention_mask=torch.ones(1, len(ids[0]), dtype=torch.long))
    assert g[0, len(ids[0]):].tolist() != expected[0], "the adapter must change the output"
    return dirs, ids, expected


@pytest.mark.parametrize("config", ["mixed", "chunked_one_slot"])
def test_adapters_match_peft(default_model_dir, world, config):
    dirs, ids, expected = world
    options = {"lora.modules": {k: str(v) for k, v in dirs.items()}}
    if config == "chunked_one_slot":
        options.update({"max_num_batched_tokens": 16, "max_num_seqs": 4, "lora.max_loras": 1,
                        "lora.max_cpu_loras": 1})
    llm = LLM(model=str(default_model_dir), quiet=True, dtype="float32", device="cpu",
              **options)
    try:
        got = [o.token_ids for o in llm.generate(
            ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), lora=ADAPTERS)]
        llm.check_integrity()
    finally:
        llm.close()
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{config}: prompt {i} (adapter {ADAPTERS[i]}) diverges from PEFT"
