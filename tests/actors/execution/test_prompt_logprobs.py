"""Prompt logprobs (SamplingParams.prompt_logprobs) from the prefill's own logits equal
transformers' log-softmax of the same weights (fp32, 1e-4): whole and chunked prefills,
several prompts in one batch, a prompt whose blocks are in the prefix cache (recomputed,
not read), top-k; and the per-request bound."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams

from tinymodel import build_tiny_model

TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-prompt-logprobs")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2), seed=11)
    return path


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax predicting prompt token i + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(out, hf, prompt: list[int], k: int) -> None:
    ref = hf_logprobs(hf, prompt)
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    assert out.prompt_token_ids == prompt
    for i, entry in enumerate(lps[1:]):
        token = prompt[i + 1]
        assert abs(entry[token] - ref[i, token].item()) < TOL, (i, entry[token])
        top = torch.topk(ref[i], k)
        want = dict(zip(top.indices.tolist(), top.values.tolist()))
        assert set(entry) == set(want) | {token}, i
        for t, v in want.items():
            assert abs(entry[t] - v) < TOL


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def test_prompt_logprobs_match_transformers_chunked_batched_and_cached(model_dir, hf,
                                                                        tmp_path):
    """1. three prompts (one of a single token) in one call, prefilled in chunks of at most
    16 tokens (the 50-token prompt takes 4 chunks), top-3 2. the same prompts again: their
    blocks are cached, yet every prompt is recomputed (no cached tokens) and gives the same
    values 3. a request without prompt logprobs still reads those blocks from the cache."""
    prompts = prompts_of([50, 23, 1])
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    with LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
             cache_dir=str(tmp_path), block_size=8, max_num_batched_tokens=16,
             max_num_seqs=4, chunking="static") as llm:
        first = llm.generate(prompts, params)
        for out, prompt in zip(first, prompts):
            check(out, hf, prompt, 3)
        again = llm.generate(prompts, params)
        for out, prompt in zip(again, prompts):
            check(out, hf, prompt, 3)
            assert out.outputs[0].timings.num_cached_tokens == 0
            assert out.outputs[0].token_ids == first[prompts.index(prompt)].outputs[0].token_ids
        plain = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2,
                                                          ignore_eos=True))[0]
        assert plain.prompt_logprobs is None
        assert plain.outputs[0].timings.num_cached_tokens == 48
        assert plain.outputs[0].token_ids == first[0].outputs[0].token_ids


def test_prompt_logprobs_zero_gives_the_prompt_token_only(model_dir, hf, tmp_path):
    prompt = prompts_of([12], seed=3)[0]
    with LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
             cache_dir=str(tmp_path)) as llm:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                    prompt_logprobs=0))[0]
    ref = hf_logprobs(hf, prompt)
    assert out.prompt_logprobs[0] is None
    for i, entry in enumerate(out.prompt_logprobs[1:]):
        assert list(entry) == [prompt[i + 1]]
        assert abs(entry[prompt[i + 1]] - ref[i, prompt[i + 1]].item()) < TOL


def test_prompt_logprobs_beyond_the_bound_end_only_that_request(model_dir, tmp_path):
    prompts = prompts_of([9, 8], seed=5)
    with LLM(model=str(model_dir), quiet=True, device="cpu", dtype="float32",
             cache_dir=str(tmp_path), max_prompt_logprobs_tokens=8) as llm:
        long, short = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert long.outputs[0].finish_reason == "error"
    assert "prompt_logprobs" in long.outputs[0].error
    assert "scheduler.max_prompt_logprobs_tokens" in long.outputs[0].error
    assert short.outputs[0].finish_reason == "length" and len(short.prompt_logprobs) == 8


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
