"""/v1/completions with `echo` and `logprobs` (what lm-eval-harness's local-completions sends
for every loglikelihood task) and vLLM's `prompt_logprobs`, over real HTTP, tiny model.
Prompt logprobs equal transformers' log-softmax of the same weights (1e-4); prompts are
prefilled in chunks of at most 16 tokens."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tokenloom.daemon.openai import responses as R

from client import apost, parse_sse

TOL = 1e-4
LONG = [3 + (i * 37) % 250 for i in range(40)]   # 40 tokens: three prefill chunks


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"),
                                 **{"scheduler.max_num_batched_tokens": 16,
                                    "scheduler.max_num_seqs": 8,
                                    "scheduler.chunking": "static",
                                    "scheduler.max_prompt_logprobs_tokens": 48}))
    yield s
    s.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)[:-1]


def name(t: int) -> str:
    return ("<unk>", "<s>", "</s>")[t] if t < 3 else f"w{t}"


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def check_echo(choice: dict, hf, prompt: list[int], k: int, generated: int) -> None:
    lp = choice["logprobs"]
    n = len(prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"]) == n + generated
    assert lp["tokens"][:n] == [f"w{i}" for i in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(n + generated)]
    ref = hf_logprobs(hf, prompt)
    for i in range(1, n):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, prompt[i]].item()) < TOL, i
        top = torch.topk(ref[i - 1], k)
        want = {name(t): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        want.setdefault(name(prompt[i]), ref[i - 1, prompt[i]].item())
        got = lp["top_logprobs"][i]
        assert set(got) == set(want), i
        assert all(abs(got[t] - want[t]) < TOL for t in want)
    assert choice["text"].startswith(words(prompt))


async def test_echo_with_logprobs_as_lm_eval_sends_it(server, model_name, hf):
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1, temperature 0, a
    batch of token-id prompts; the logprobs of each choice are its prompt's then the one
    generated token's, choices in prompt order."""
    prompts = [LONG, [5, 6, 7], [9]]
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt=prompts, echo=True, logprobs=1, max_tokens=1,
        temperature=0, seed=1234))
    assert status == 200, body
    msgspec.convert(body, R.CompletionResponse)   # the shape /openapi.json states
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, prompt in zip(body["choices"], prompts):
        check_echo(choice, hf, prompt, 1, generated=1)
        assert choice["logprobs"]["token_logprobs"][-1] is not None
        assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 44 and body["usage"]["completion_tokens"] == 3


async def test_echo_of_a_text_prompt_again_is_recomputed_not_read_from_the_cache(
        server, model_name, hf):
    prompt = words(LONG)
    bodies = []
    for _ in range(2):
        status, body, _ = await apost(server, "/v1/completions", dict(
            model=model_name, prompt=prompt, echo=True, logprobs=3, max_tokens=2,
            temperature=0))
        assert status == 200, body
        check_echo(body["choices"][0], hf, LONG, 3, generated=2)
        bodies.append(body)
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert bodies[0]["choices"] == bodies[1]["choices"]


async def test_max_tokens_zero_returns_the_prompt_only(server, model_name, hf):
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt=[[5, 6, 7], [8, 9, 10, 11]], echo=True, logprobs=0,
        max_tokens=0))
    assert status == 200, body
    for choice, prompt in zip(body["choices"], [[5, 6, 7], [8, 9, 10, 11]]):
        assert choice["text"] == words(prompt)
        check_echo(choice, hf, prompt, 0, generated=0)
        assert all(len(t) == 1 for t in choice["logprobs"]["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0


async def test_echo_without_logprobs_prepends_the_prompt(server, model_name):
    _, plain, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt=[5, 6, 7], max_tokens=3, temperature=0))
    _, echoed, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt=[5, 6, 7], echo=True, max_tokens=3, temperature=0))
    assert echoed["choices"][0]["text"] == "w5 w6 w7" + plain["choices"][0]["text"]
    assert echoed["choices"][0]["logprobs"] is None


async def test_vllm_prompt_logprobs_field(server, model_name, hf):
    status, body, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt="w5 w6 w7 w8", prompt_logprobs=2, max_tokens=1))
    assert status == 200, body
    msgspec.convert(body, R.CompletionResponse)
    (choice,) = body["choices"]
    plp = choice["prompt_logprobs"]
    ref = hf_logprobs(hf, [5, 6, 7, 8])
    assert plp[0] is None and len(plp) == 4
    for i, token in enumerate([6, 7, 8]):
        entry = plp[i + 1]
        mine = entry[str(token)]
        assert abs(mine["logprob"] - ref[i, token].item()) < TOL
        assert mine["rank"] == int((ref[i] > ref[i, token]).sum()) + 1
        assert mine["decoded_token"] == name(token)
        top = torch.topk(ref[i], 2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert abs(entry[str(t)]["logprob"] - v) < TOL
            assert entry[str(t)]["rank"] == rank or t == token
    assert choice["logprobs"] is None and not choice["text"].startswith("w5 w6")


async def test_streamed_echo_equals_the_whole_response(server, model_name):
    """vLLM's streaming echo: each choice's first chunk carries the prompt's text and its
    tokens' logprobs; chunks add up to the non-streamed choice."""
    body = dict(model=model_name, prompt=[LONG[:20], [5, 6, 7]], echo=True, logprobs=1,
                max_tokens=4, temperature=0, ignore_eos=True)
    _, whole, _ = await apost(server, "/v1/completions", body)
    status, raw, _ = await apost(server, "/v1/completions", {**body, "stream": True})
    assert status == 200
    events = parse_sse(raw)[:-1]
    for choice in whole["choices"]:
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in chunks) == choice["text"]
        assert chunks[0]["logprobs"]["token_logprobs"][0] is None
        for field in ("tokens", "token_logprobs", "text_offset"):
            got = [x for c in chunks if c["logprobs"] for x in c["logprobs"][field]]
            assert got == choice["logprobs"][field], field


@pytest.mark.parametrize("fields, param", [
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(echo=True, logprobs=21), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(echo=True, logprobs=1, prompt=LONG + LONG), "echo"),
    (dict(prompt_logprobs=0, prompt=LONG + LONG), "prompt_logprobs"),
])
async def test_bad_echo_and_prompt_logprobs_fields_are_400_naming_the_field(
        server, model_name, fields, param):
    status, body, _ = await apost(server, "/v1/completions", {
        "model": model_name, "prompt": "w5 w6", "max_tokens": 1, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param, body
    if param in ("echo", "prompt_logprobs") and "prompt" in fields:
        assert "scheduler.max_prompt_logprobs_tokens" in body["error"]["message"]
