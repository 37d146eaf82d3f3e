"""CUDA-only checks of speculative decoding (run by `make gpu-check`; skipped, with the
reason, where no CUDA GPU exists). A tiny random model is its own draft model, so nearly
every draft is accepted and the whole path runs on the device: the mirrored draft KV, the
draft's k decode steps with the Triton kernel, verification rows laid out as chunks, the
rejection rule with CUDA generators, and the rollback.
1. greedy output equals transformers' with speculation on (and with prompt lookup);
2. sampled output runs and is reproducible for a seed;
3. the KV pool is whole afterwards.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (none here); run `make gpu-check` on a GPU host"),
]


def test_speculation_on_the_gpu_is_exact(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("msgspec")
    from transformers import AutoModelForCausalLM

    from tokenloom import LLM, SamplingParams

    from tinymodel import VOCAB, build_tiny_model, hf_greedy

    path = tmp_path / "m"
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2), seed=3)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (40, 9, 70)]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculative="on")
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True,
                             speculative="on")
    for method in ("draft", "ngram"):
        options = {"speculative.method": method, "speculative.num_speculative_tokens": 3}
        if method == "draft":
            options["speculative.draft_model"] = str(path)
        runs = []
        for _ in range(2):
            llm = LLM(model=str(path), quiet=True, device="cuda", dtype="float32",
                      cache_dir=str(tmp_path / "cache"), block_size=16, max_num_seqs=8,
                      num_blocks=128, **options)
            try:
                got = [o.token_ids for o in llm.generate(prompts, greedy)]
                runs.append([o.token_ids for o in llm.generate(prompts[:1], sampled)])
                spec = llm.scheduler_stats().spec
                llm.check_integrity()
                assert llm.kv_stats().used == 0
            finally:
                llm.close()
            assert got == expected, method
            if method == "draft":
                assert spec.num_accepted_tokens >= 0.9 * spec.num_draft_tokens > 0, spec
        assert runs[0] == runs[1] and len(runs[0][0]) == 16, method
