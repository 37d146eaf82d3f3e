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


def test_piecewise_steps_give_the_same_prompt_logprobs(model_dir, hf):
    """The piecewise path (graphs/piecewise.py; on CPU its pieces run eagerly over the
    static buffers) sends the prompt rows of the same residual stream through the LM head:
    two prompts in chunks of 8 (mid-block, mid-prompt), batched in the same steps, give
    transformers' values; a chunk not marked gives none."""
    from tokenloom.actors.execution.model_runner import ModelRunner
    from tokenloom.actors.messages import ExecuteBatch, NewSequence, ScheduledSequence
    from tokenloom.graphs.buckets import PaddedSizeTable
    from tokenloom.graphs.dispatch import Dispatcher
    from tokenloom.graphs.piecewise import PiecewiseBuffers, PiecewiseGraphs
    from tokenloom.kernels.kv_store import KVCache
    from tokenloom.kernels.models.loader import load_model, load_spec

    spec = load_spec(model_dir)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"),
                          spec.max_position_embeddings)
    kv = KVCache.allocate(spec.num_layers, 32, 8, spec.num_kv_heads, spec.head_dim,
                          torch.float32, "cpu")
    pieces = PiecewiseGraphs(model, kv, PiecewiseBuffers(model, 32, "cpu"))
    runner = ModelRunner(model, kv, torch.device("cpu"), (2,), piecewise=pieces,
                         dispatcher=Dispatcher(None, token_table=PaddedSizeTable((8, 16, 32))))
    prompts = prompts_of([21, 9, 5], seed=8)
    tables = [list(range(1, 5)), list(range(5, 9)), list(range(9, 11))]
    wants = [2, 0, None]
    got: dict[str, list] = {f"r{i}": [] for i in range(3)}
    done = [0, 0, 0]
    for step in range(3):
        seqs = []
        for i, p in enumerate(prompts):
            if done[i] == len(p):
                continue
            end = min(done[i] + 8, len(p))
            params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=wants[i])
            seqs.append(ScheduledSequence(
                request_id=f"r{i}", token_ids=p[done[i]:end], start_pos=done[i],
                block_table=tables[i], sample=end == len(p),
                prompt_logprobs=wants[i] is not None,
                new=NewSequence(prompt_token_ids=p, output_token_ids=[],
                                sampling_params=params) if done[i] == 0 else None))
            done[i] = end
        out = runner.execute(ExecuteBatch(step=step, sequences=seqs, num_decodes=0))
        for chunk in out.prompt_logprobs:
            assert chunk.start == len(got[chunk.request_id])
            got[chunk.request_id].extend(chunk.logprobs)
    assert runner.graph_stats().piecewise_steps == 3
    assert got["r2"] == []
    for i in (0, 1):
        ref = hf_logprobs(hf, prompts[i])
        lps = got[f"r{i}"]
        assert [lp.token_id for lp in lps] == prompts[i][1:]
        for j, lp in enumerate(lps):
            assert abs(lp.logprob - ref[j, lp.token_id].item()) < TOL
            assert lp.rank == int((ref[j] > ref[j, lp.token_id]).sum()) + 1
            if wants[i]:
                top = torch.topk(ref[j], wants[i])
                assert [t for t, _ in lp.top] == top.indices.tolist()
            else:
                assert lp.top is None


def test_chunks_recomputed_after_a_preemption_keep_what_is_known():
    from tokenloom.actors.scheduling.request import Request

    req = Request("r", list(range(3, 13)), SamplingParams(prompt_logprobs=0))
    assert req.wants_prompt_logprobs
    req.add_prompt_logprobs(0, ["a", "b", "c"])       # positions 0-2: tokens 1-3
    req.add_prompt_logprobs(0, ["x", "y", "z", "d"])  # recomputed from 0: only "d" is new
    req.add_prompt_logprobs(6, ["g"])                 # a gap: not taken
    req.add_prompt_logprobs(4, ["e", "f", "g", "h", "i"])
    assert req.prompt_logprobs == ["a", "b", "c", "d", "e", "f", "g", "h", "i"]
    assert not req.wants_prompt_logprobs
    assert Request("q", [5], SamplingParams()).prompt_logprobs is None
