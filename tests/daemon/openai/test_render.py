"""The render endpoints (/v1/completions/render, /v1/chat/completions/render) over real HTTP:
vLLM's response shapes, and token ids that are exactly the engine's prompt for the same body
(a completion from the rendered ids is the chat's answer, and hits the blocks the chat
request cached: the keys an external index computes from them match the KV events)."""

from __future__ import annotations

from client import apost

GREEDY = dict(temperature=0, ignore_eos=True)
RENDERED_KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream",
                 "stream_options", "cache_salt", "priority", "kv_transfer_params"}


async def test_completion_render_shape_and_ids(server, model_name):
    status, body, _ = await apost(server, "/v1/completions/render", dict(
        model=model_name, prompt="w5 w6 w7", max_tokens=4, temperature=0.5, cache_salt="s1",
        priority=3))
    assert status == 200, body
    (one,) = body                        # an array: one object per prompt, as vLLM
    assert set(one) == RENDERED_KEYS
    assert one["token_ids"] == [5, 6, 7]
    assert one["request_id"].startswith("cmpl-") and one["model"] == model_name
    assert one["features"] is None and one["kv_transfer_params"] is None
    assert one["cache_salt"] == "s1" and one["priority"] == 3
    assert one["stream"] is False and one["stream_options"] is None
    params = one["sampling_params"]
    assert params["max_tokens"] == 4 and params["temperature"] == 0.5 and params["n"] == 1
    assert params["stop"] == [] and params["stop_token_ids"] == []


async def test_completion_render_one_object_per_prompt_whatever_n(server, model_name):
    for prompt, expected in ((["w5 w6", "w7"], [[5, 6], [7]]), ([[9, 8], [7, 6, 5]],
                                                                [[9, 8], [7, 6, 5]])):
        status, body, _ = await apost(server, "/v1/completions/render", dict(
            model=model_name, prompt=prompt, n=3, max_tokens=2))
        assert status == 200, body
        assert [r["token_ids"] for r in body] == expected
        assert all(r["sampling_params"]["n"] == 3 for r in body)


async def test_chat_render_is_the_engine_prompt(server, model_name):
    """1. render a chat; 2. the chat itself (greedy) reports as many prompt tokens; 3. a
    completion from the rendered ids gives the same text and finds the chat's prompt blocks
    in the prefix cache (same ids, same block hashes)."""
    messages = [{"role": "system", "content": "w40 w41 w42 w43 w44 w45"},
                {"role": "user", "content": "w50 w51 w52 w53 w54 w55 w56 w57 w58"}]
    status, rendered, _ = await apost(server, "/v1/chat/completions/render", dict(
        model=model_name, messages=messages, max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    assert status == 200, rendered
    assert set(rendered) == RENDERED_KEYS and rendered["request_id"].startswith("chatcmpl-")
    assert rendered["stream"] is True
    assert rendered["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    ids = rendered["token_ids"]
    assert ids[-1] == 3 and ids[:6] == [40, 41, 42, 43, 44, 45]   # the template's "w3" last
    _, chat, _ = await apost(server, "/v1/chat/completions", dict(
        model=model_name, messages=messages, max_tokens=6, **GREEDY))
    assert chat["usage"]["prompt_tokens"] == len(ids)
    _, again, _ = await apost(server, "/v1/completions", dict(
        model=model_name, prompt=ids, max_tokens=6, **GREEDY))
    assert again["choices"][0]["text"].strip() == chat["choices"][0]["message"]["content"].strip()
    block = server.engine.config.cache.block_size
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        (len(ids) - 1) // block * block > 0


async def test_chat_render_fills_max_tokens_as_generation_does(server, model_name):
    """No max_tokens: what the context window leaves (as vLLM's render reports it)."""
    status, rendered, _ = await apost(server, "/v1/chat/completions/render", dict(
        model=model_name, messages=[{"role": "user", "content": "w5 w6"}]))
    assert status == 200, rendered
    max_len = server.engine.info.max_model_len
    assert rendered["sampling_params"]["max_tokens"] == max_len - len(rendered["token_ids"])


async def test_chat_render_with_tools_matches_generation(server, model_name):
    tools = [{"type": "function", "function": {"name": "f", "description": "w7 w8",
                                               "parameters": {"type": "object"}}}]
    body = dict(model=model_name, messages=[{"role": "user", "content": "w5 w6"}], tools=tools,
                max_tokens=2)
    status, rendered, _ = await apost(server, "/v1/chat/completions/render", body)
    assert status == 200, rendered
    _, chat, _ = await apost(server, "/v1/chat/completions", dict(body, **GREEDY))
    assert chat["usage"]["prompt_tokens"] == len(rendered["token_ids"]) > 4


async def test_render_without_model_names_the_served_one(server, model_name):
    status, body, _ = await apost(server, "/v1/completions/render", dict(prompt="w5"))
    assert status == 200, body
    assert body[0]["model"] == model_name and body[0]["token_ids"] == [5]
