"""POST /v1/embeddings (`server.embeddings`, --embeddings) on tiny random Llamas, against
transformers' own base model on the same weights as the oracle (fp32, same pooling):

1. last-token pooling (no sentence-transformers files: a decoder's default), normalized:
   equal to transformers' final-normed last hidden state within 1e-5; a batch equals the
   inputs one by one; token-id inputs; the official `openai` client (base64 by default)
   gets the same vectors; a repeated input is served from the prefix cache, same vector;
2. mean pooling as modules.json / 1_Pooling say, over prompts prefilled in several chunks,
   with Matryoshka `dimensions` (cut, renormalized) where config.json allows them;
3. bad input is a 400 naming the field; generation runs beside embeddings; without
   server.embeddings there is no such route."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import shutil

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai")

INPUTS = ["w5 w6 w7", "w9", "w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22",
          " ".join(f"w{i}" for i in range(30, 75))]


def reference(model_dir, texts, pooling: str) -> list[np.ndarray]:
    """transformers' base model: its last_hidden_state (final norm applied), pooled."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = torch.tensor([tok.encode(text)])
        with torch.inference_mode():
            h = model(input_ids=ids).last_hidden_state[0]            # [T, hidden]
        v = h[-1] if pooling == "last" else h.mean(0)
        out.append(v.numpy())
    return out


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def last_server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache"),
                                 **{"server.embeddings": True}))
    yield s
    s.close()


def write_sentence_transformers_files(path, pooling: dict) -> None:
    """sentence-transformers' files beside a checkpoint: Transformer, then Pooling with
    this config, then Normalize."""
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))


@pytest.fixture(scope="module")
def mean_model_dir(tiny_model_dir, tmp_path_factory):
    """The same weights with sentence-transformers' files: mean pooling, normalized, and
    Matryoshka dimensions."""
    path = tmp_path_factory.mktemp("tiny-mean") / "model"
    shutil.copytree(tiny_model_dir, path)
    write_sentence_transformers_files(path, {
        "word_embedding_dimension": 64, "pooling_mode_mean_tokens": True,
        "pooling_mode_lasttoken": False, "pooling_mode_cls_token": False})
    config = json.loads((path / "config.json").read_text())
    config["matryoshka_dimensions"] = [16, 32, 64]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def mean_server(mean_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    # 16-token steps: the longer inputs are prefilled in several chunks.
    s = ServerThread(tiny_config(mean_model_dir, tmp_path_factory.mktemp("cache"),
                                 **{"server.embeddings": True,
                                    "scheduler.max_num_batched_tokens": 16,
                                    "scheduler.max_num_seqs": 16}))
    yield s
    s.close()


def embed(server, inputs, **body) -> tuple[list[np.ndarray], dict]:
    r = httpx.post(server.url + "/v1/embeddings", json={"input": inputs, **body}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [d["index"] for d in data["data"]] == list(range(len(data["data"])))
    return [np.asarray(d["embedding"], dtype=np.float32) for d in data["data"]], data


def test_last_token_pooling_equals_transformers(last_server, tiny_model_dir):
    got, data = embed(last_server, INPUTS)
    for g, ref in zip(got, reference(tiny_model_dir, INPUTS, "last")):
        np.testing.assert_allclose(g, unit(ref), atol=1e-5, rtol=0)
        assert abs(np.linalg.norm(g) - 1) < 1e-5
    tok_counts = [len(s.split()) for s in INPUTS]
    assert data["usage"] == {"prompt_tokens": sum(tok_counts), "total_tokens": sum(tok_counts)}
    assert data["object"] == "list" and data["data"][0]["object"] == "embedding"


def test_a_batch_equals_one_by_one(last_server):
    batch, _ = embed(last_server, INPUTS)
    for text, b in zip(INPUTS, batch):
        [one], _ = embed(last_server, text)
        np.testing.assert_allclose(b, one, atol=1e-5, rtol=0)


def test_token_ids_and_the_openai_client(last_server, model_name):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(last_server.engine.info.model_dir)
    ids = [tok.encode(t) for t in INPUTS[:2]]
    by_text, _ = embed(last_server, INPUTS[:2])
    by_ids, _ = embed(last_server, ids)
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    client = openai.OpenAI(base_url=last_server.url + "/v1", api_key="unused", max_retries=0)
    r = client.embeddings.create(model=model_name, input=INPUTS[:2])   # base64 on the wire
    np.testing.assert_allclose(np.asarray([d.embedding for d in r.data]), by_text, atol=1e-6)
    raw = httpx.post(last_server.url + "/v1/embeddings", json={
        "input": INPUTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(raw), "<f4"), by_text[0])


def test_a_repeated_input_comes_from_the_prefix_cache(last_server):
    text = " ".join(f"w{i}" for i in range(100, 140))
    first, _ = embed(last_server, text)
    before = last_server.stats().kv.prefix_cache
    again, _ = embed(last_server, text)
    after = last_server.stats().kv.prefix_cache
    assert after.hit_tokens - before.hit_tokens >= 32   # the full blocks of 40 tokens
    np.testing.assert_allclose(again[0], first[0], atol=1e-5)


def test_mean_pooling_over_chunks_and_matryoshka(mean_server, mean_model_dir):
    refs = reference(mean_model_dir, INPUTS, "mean")
    got, _ = embed(mean_server, INPUTS)
    for g, ref in zip(got, refs):
        np.testing.assert_allclose(g, unit(ref), atol=1e-5, rtol=0)
    cut, _ = embed(mean_server, INPUTS, dimensions=16)
    for g, ref in zip(cut, refs):
        assert g.shape == (16,)
        np.testing.assert_allclose(g, unit(ref[:16]), atol=1e-5, rtol=0)
    r = httpx.post(mean_server.url + "/v1/embeddings", json={"input": "w5", "dimensions": 20})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    # The long input was pooled over several prefill chunks (its trace says how many).
    r = httpx.post(mean_server.url + "/v1/embeddings", json={"input": INPUTS[3]})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], unit(refs[3]), atol=1e-5)
    trace = httpx.get(f"{mean_server.url}/v1/requests/{r.headers['X-Request-Id']}/trace")
    assert trace.json()["prefill_chunks"] >= 3


@pytest.mark.parametrize("body, param", [
    ({"input": "w5", "dimensions": 8}, "dimensions"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[5, -1]]}, "input"),
    ({"input": "w5", "encoding_format": "hex"}, "encoding_format"),
    ({"input": " ".join(["w5"] * 2048)}, "input"),
    ({"input": "w5", "model": "other"}, "model"),
])
def test_bad_input_names_the_field(last_server, body, param):
    r = httpx.post(last_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_generation_runs_beside_embeddings(last_server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        chats = [pool.submit(httpx.post, last_server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 8}, timeout=60)
            for _ in range(2)]
        embeds = [pool.submit(embed, last_server, INPUTS) for _ in range(2)]
        assert all(f.result().status_code == 200 for f in chats)
        a, b = (f.result()[0] for f in embeds)
    np.testing.assert_allclose(a, b, atol=1e-5)
    idle = last_server.wait_idle()
    assert idle["used"] == 0 and idle["streams"] == 0


def test_no_route_without_server_embeddings(tiny_model_dir, tmp_path):
    from tokenloom.daemon.app import create_app

    from servers import tiny_config

    app = create_app(tiny_config(tiny_model_dir, tmp_path), engine=object())
    assert "/v1/embeddings" not in {r.canonical for r in app.router.resources()}


def test_the_cli_flags(tiny_model_dir, tmp_path):
    """`tokenloom serve --embeddings --reasoning-parser none` serves the route; embeddings
    with worker processes are a config error (exit 2, naming the key) before loading."""
    import subprocess

    from servers import TOKENLOOM, ServerProcess

    bad = subprocess.run([TOKENLOOM, "serve", "--model", str(tiny_model_dir), "--embeddings",
                          "--workers", "2", "--port", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "server.embeddings" in bad.stderr
    server = ServerProcess("--model", str(tiny_model_dir), "--embeddings",
                           "--reasoning-parser", "none", "--set", "model.device=cpu",
                           "--set", f'model.cache_dir="{tmp_path}"',
                           "--set", "cache.num_blocks=64", "--set", "cache.block_size=8")
    try:
        r = httpx.post(server.url + "/v1/embeddings", json={"input": "w5 w6"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    finally:
        assert server.stop() == 0


def test_a_qwen3_embedding_shaped_model(tmp_path_factory):
    """A tiny random Qwen3 (q/k norms) with Qwen3-Embedding's sentence-transformers files
    (last-token pooling, then Normalize): equal to transformers' Qwen3Model; and, being
    Qwen3, its thinking is split by the "auto" reasoning parser."""
    from servers import ServerThread, tiny_config
    from tinymodel import CHAT_TEMPLATE, build_tiny_model

    path = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    build_tiny_model(path, "Qwen3Config", dict(num_hidden_layers=2, head_dim=32,
                                               tie_word_embeddings=True),
                     seed=3, chat_template=CHAT_TEMPLATE)
    write_sentence_transformers_files(path, {"pooling_mode_lasttoken": True,
                                             "include_prompt": True})
    s = ServerThread(tiny_config(path, tmp_path_factory.mktemp("cache"),
                                 **{"server.embeddings": True}))
    try:
        got, _ = embed(s, INPUTS)
        for g, ref in zip(got, reference(path, INPUTS, "last")):
            np.testing.assert_allclose(g, unit(ref), atol=1e-5, rtol=0)
        assert s.app[next(iter(s.app))].reasoning.parser.name == "think"
    finally:
        s.close()
