"""LoRA adapters over HTTP, as a vLLM client uses them (the official openai client and raw
requests against a real server on 127.0.0.1):

1. /v1/models lists each adapter with the base model as its parent;
2. `model` = an adapter runs it: greedy text equals transformers + PEFT with that adapter,
   and the base model's name still runs the base model (the trace says which adapter ran);
3. an unknown model is a 404 that lists the adapters;
4. POST /v1/load_lora_adapter serves a new adapter at once; a bad one (missing directory,
   rank over the limit, a duplicate name) is a 400 naming it, and the daemon keeps serving;
   /v1/unload_lora_adapter stops it (404 on the next use);
5. /metrics: vllm:lora_requests_info carries max_lora, per-adapter request counts and loads;
   admin stats has a LoRA row.
"""

from __future__ import annotations

import re

import aiohttp
import openai
import pytest
import torch

from tokenloom.daemon.admin import cli as admin_cli
from tokenloom.daemon.admin import protocol as P

from tinymodel import build_random_adapter, peft_oracle

PROMPT = "w5 w6 w7 w8 w9 w10 w11 w12 w13 w40 w41"


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": build_random_adapter(tiny_model_dir, root / "sql", rank=8, seed=3),
            "chat": build_random_adapter(tiny_model_dir, root / "chat", rank=4, seed=4,
                                         targets=("q_proj", "v_proj", "down_proj")),
            "big": build_random_adapter(tiny_model_dir, root / "big", rank=32, seed=5)}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, adapters):
    from servers import ServerThread, tiny_config

    tmp = tmp_path_factory.mktemp("lora-http")
    cfg = tiny_config(tiny_model_dir, tmp / "cache",
                      **{"admin.socket_path": str(tmp / "admin.sock"),
                         "lora.modules": {"sql": str(adapters["sql"])},
                         "lora.allow_runtime_updates": True, "lora.max_loras": 2})
    s = ServerThread(cfg)
    yield s
    s.close()


def oracle_text(base_dir, adapter_dir, n=10) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    model = peft_oracle(base_dir, adapter_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_models_lists_adapters_with_their_parent(server, model_name):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {model_name, "sql"}
    assert models["sql"].parent == model_name and models[model_name].parent is None


def test_adapter_requests_match_peft_and_are_traced(server, tiny_model_dir, model_name,
                                                    adapters):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")

    def complete(model):
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=10,
                                      temperature=0, extra_body={"ignore_eos": True})
        return r

    sql = complete("sql")
    base = complete(model_name)
    assert sql.model == "sql"
    assert sql.choices[0].text.strip() == oracle_text(tiny_model_dir, adapters["sql"]).strip()
    assert base.choices[0].text.strip() == oracle_text(tiny_model_dir, None).strip()
    assert sql.choices[0].text != base.choices[0].text
    trace = server.call(server.engine.trace(sql.id))
    assert trace["meta"]["lora"] == "sql"
    with pytest.raises(openai.NotFoundError, match="LoRA adapters: sql"):
        complete("nope")


async def test_runtime_load_and_unload(server, tiny_model_dir, adapters):
    url = server.url
    async with aiohttp.ClientSession() as s:
        async def post(path, body):
            async with s.post(url + path, json=body) as r:
                return r.status, await r.text()

        status, text = await post("/v1/load_lora_adapter",
                                  {"lora_name": "chat", "lora_path": str(adapters["chat"])})
        assert status == 200 and "chat" in text
        status, text = await post("/v1/load_lora_adapter",
                                  {"lora_name": "chat", "lora_path": str(adapters["chat"])})
        assert status == 400 and "already been loaded" in text
        status, text = await post("/v1/load_lora_adapter",
                                  {"lora_name": "big", "lora_path": str(adapters["big"])})
        assert status == 400 and "'big'" in text and "max_lora_rank = 16" in text
        status, text = await post("/v1/load_lora_adapter",
                                  {"lora_name": "gone", "lora_path": "/nonexistent/adapter"})
        assert status == 400 and "'gone'" in text and "not a directory" in text
        body = dict(model="chat", prompt=PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            text = (await r.json())["choices"][0]["text"]
        assert text.strip() == oracle_text(tiny_model_dir, adapters["chat"]).strip()
        status, _ = await post("/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert status == 200
        status, text = await post("/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert status == 404 and "cannot be found" in text
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 404
        async with s.get(url + "/v1/models") as r:
            assert "chat" not in {m["id"] for m in (await r.json())["data"]}


async def test_metrics_and_admin_show_adapters(server, model_name):
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=dict(
                model="sql", prompt=PROMPT, max_tokens=4, temperature=0)) as r:
            assert r.status == 200
        server.wait_idle()
        server.engine.runner.lora_snapshot = server.engine.runner.model_runner.lora_stats()
        async with s.get(server.url + "/metrics") as r:
            text = await r.text()
    assert re.search(r'^vllm:lora_requests_info\{.*max_lora="2".*\} \d', text, re.M)
    sql = r'\{[^}]*lora_name="sql"[^}]*\}'
    n = re.search(rf"^tokenloom:lora_requests_total{sql} (\d+)\.0$", text, re.M)
    assert n and int(n.group(1)) >= 1
    assert re.search(rf"^tokenloom:lora_resident_info{sql} 1\.0$", text, re.M)
    loads = re.search(r"^tokenloom:lora_loads_total\{.*\} (\d+)\.0$", text, re.M)
    assert loads and int(loads.group(1)) >= 1
    assert re.search(r"^tokenloom:lora_loads_from_host_total\{.*\} \d+\.0$", text, re.M)
    reply = admin_cli.send(server.engine.config.admin.socket_path, P.Stats(), timeout=30)
    rendered = admin_cli._render_stats(reply)
    assert re.search(r"LoRA adapters\s+\d+ served, \d / 2 slots held \([^)]*sql", rendered), \
        rendered


async def test_openapi_documents_the_lora_routes(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/openapi.json") as r:
            doc = await r.json()
    routes = {r.canonical for r in server.app.router.resources()}
    assert routes == set(doc["paths"])
    assert "/v1/load_lora_adapter" in doc["paths"]
    model = doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]
    assert "enum" not in model   # adapters come and go: a name, not a closed list
