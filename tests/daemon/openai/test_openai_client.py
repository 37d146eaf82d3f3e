"""The official `openai` client against `tokenloom serve` running as a subprocess on
127.0.0.1 (tiny random model): completions and chat, streaming and not, n=2, stop, logprobs,
usage, the opt-in metrics; errors as the client's exception types; JSON log lines carrying
the request id; a clean exit on SIGTERM; exit status 2 on a bad config."""

from __future__ import annotations

import subprocess

import pytest

openai = pytest.importorskip("openai")

from servers import TOKENLOOM, ServerProcess, wait_for  # noqa: E402


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    server = ServerProcess("--model", str(tiny_model_dir), "--set", "model.device=cpu",
                           "--set", f'model.cache_dir="{cache}"', "--set", "cache.block_size=8",
                           "--set", "cache.num_blocks=512", "--set", "server.log_level=debug",
                           "--set", "model.num_threads=1")
    yield server
    assert server.stop() == 0, "\n".join(server.lines[-20:])


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def test_completion(client, model_name):
    r = client.completions.create(model=model_name, prompt="w5 w6 w7", max_tokens=6, **GREEDY)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text.split()) == 6
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == 9


def test_completion_stream_equals_non_stream(client, model_name):
    full = client.completions.create(model=model_name, prompt="w8 w9", max_tokens=7, **GREEDY)
    chunks = list(client.completions.create(model=model_name, prompt="w8 w9", max_tokens=7,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_chat(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "w11 w12"}], max_tokens=5,
        **GREEDY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_usage(client, model_name):
    messages = [{"role": "user", "content": "w11 w12"}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=5,
                                          **GREEDY)
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=5,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 5


def test_n_2(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "w11"}], max_tokens=6, n=2,
        temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 12


def test_stop(client, model_name):
    full = client.completions.create(model=model_name, prompt="w40", max_tokens=8, **GREEDY)
    stop = full.choices[0].text.split()[2]
    r = client.completions.create(model=model_name, prompt="w40", max_tokens=8, stop=[stop],
                                  **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full.choices[0].text[: full.choices[0].text.index(stop)]


def test_logprobs(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "w11"}], max_tokens=3,
        logprobs=True, top_logprobs=3, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    c = client.completions.create(model=model_name, prompt="w5", max_tokens=3, logprobs=2,
                                  **GREEDY)
    assert len(c.choices[0].logprobs.tokens) == 3
    assert len(c.choices[0].logprobs.top_logprobs[0]) >= 2


def test_metrics_object_via_extra_body(client, model_name):
    r = client.completions.create(model=model_name, prompt="w5", max_tokens=3, temperature=0,
                                  extra_body={"return_metrics": True})
    metrics = r.model_extra["metrics"]
    assert metrics["time_to_first_token"] > 0 and metrics["num_preemptions"] == 0


def test_errors_are_client_exceptions(client, model_name):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="w5")
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="w5", temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_models(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_log_lines_are_json_with_request_ids(client, served, model_name):
    """Lines about a request carry its id, from the HTTP layer and from the actors."""
    r = client.completions.create(model=model_name, prompt="w5", max_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt="w5", max_tokens=5000)

    def logged() -> bool:   # the reply can overtake the log lines on their way to our reader
        lines = served.json_lines()
        refused = [line for line in lines if line.get("event") == "request rejected"]
        return bool(refused) and any(line.get("request_id") == refused[-1]["request_id"]
                                     and line["event"] == "http" for line in lines)

    wait_for(logged, 10)
    lines = served.json_lines()
    about = [line for line in lines if str(line.get("request_id", "")).startswith(r.id)]
    assert {"request", "choice finished", "http"} <= {line["event"] for line in about}
    assert all("timestamp" in line and "level" in line for line in lines)
    refused = [line for line in lines if line.get("event") == "request rejected"]
    assert refused and refused[-1]["actor"] == "tokenizer"
    rid = refused[-1]["request_id"]
    assert rid.startswith("cmpl-")
    http = [line for line in lines if line.get("request_id") == rid and line["event"] == "http"]
    assert http and http[0]["status"] == 400


def test_sigterm_drains_and_exits_zero(tiny_model_dir, tmp_path):
    """1. the server starts; 2. SIGTERM; 3. the process exits with status 0."""
    server = ServerProcess("--model", str(tiny_model_dir), "--set", "model.device=cpu",
                           "--set", f'model.cache_dir="{tmp_path}"', "--set",
                           "cache.num_blocks=64", "--set", "model.num_threads=1")
    assert server.stop() == 0
    assert any(line.get("event") == "stopped" for line in server.json_lines())


@pytest.mark.parametrize("args, key", [
    (["--set", "server.bogus=1"], "server.bogus"),
    (["--set", "scheduler.max_num_seqs=0"], "scheduler.max_num_seqs"),
    (["--port", "70000"], "server.port"),
])
def test_bad_config_exits_2_naming_the_key(args, key):
    p = subprocess.run([TOKENLOOM, "serve", *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and key in p.stderr, p.stderr


def test_bad_config_file_exits_2(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nmax_n = 0\n")
    p = subprocess.run([TOKENLOOM, "serve", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "server.max_n" in p.stderr, p.stderr
