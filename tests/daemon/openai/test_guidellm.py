"""guidellm, a benchmark client built for vLLM, runs unchanged against `tokenloom serve`.

Its real CLI (`guidellm run`) streams chat completions with
`stream_options: {include_usage, continuous_usage_stats}` and `ignore_eos`, synthesising
prompts of an exact token count with the served model's own tokenizer (a local directory:
nothing is downloaded, HF_HUB_OFFLINE=1). The tiny model here has a byte-level tokenizer,
since guidellm builds prompts by decoding token ids and the word-level one cannot
round-trip text.

1. start `tokenloom serve` (a subprocess) and read its token counters;
2. run guidellm: 8 requests, 4 concurrent streams, 16 prompt tokens, 8 output tokens;
3. every request succeeded (no errors, none incomplete), each produced its 8 tokens;
4. guidellm's recorded token counts add up to the server's /metrics counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client import metric, metrics

pytest.importorskip("guidellm", reason="guidellm is in the test extra (pyproject.toml)")

GUIDELLM = str(Path(sys.executable).with_name("guidellm"))
TEMPLATE = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}> {% endif %}")
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 16, 8


@pytest.fixture(scope="module")
def byte_model_dir(tmp_path_factory):
    from tinymodel import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-bytes")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True,
                                               max_position_embeddings=2048), seed=7,
                     chat_template=TEMPLATE, byte_tokenizer=True)
    return path


def guidellm_command(url: str, model_dir: Path, output: Path) -> list[str]:
    """The command line (also in docs/http-api.md, "Benchmark clients")."""
    return [GUIDELLM, "run",
            "--backend", f"kind=openai_http,target={url},model={model_dir.name}",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                      f"output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
            "--output", f"kind=json,path={output}",
            "--disable-console-interactive"]


def test_guidellm_benchmark_runs_clean(byte_model_dir, tmp_path):
    from servers import ServerProcess

    server = ServerProcess("--model", str(byte_model_dir), "--set", "model.device=cpu",
                           "--set", "model.dtype=float32",
                           "--set", f"model.cache_dir={tmp_path / 'cache'}",
                           "--set", "cache.block_size=8", "--set", "cache.num_blocks=1024",
                           "--set", f"admin.socket_path={tmp_path / 'admin.sock'}",
                           timeout=300)
    try:
        name = byte_model_dir.name
        before = metrics(server)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1",
               "GUIDELLM__LOGGING__LOG_FILE": str(tmp_path / "guidellm.log"),
               "OMP_NUM_THREADS": "1"}
        out = tmp_path / "report.json"
        run = subprocess.run(guidellm_command(server.url, byte_model_dir, out), env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        after = metrics(server)
    finally:
        assert server.stop() == 0
    (bench,) = json.loads(out.read_text())["benchmarks"]
    reqs = bench["requests"]
    assert not reqs["errored"] and not reqs["incomplete"], reqs["errored"][:1]
    done = reqs["successful"]
    assert len(done) == REQUESTS
    assert all(r["output_tokens"] == OUTPUT_TOKENS for r in done)
    # The prompt: guidellm's 16 tokens plus the chat template's 3 ("\n", "> ").
    assert all(r["prompt_tokens"] == PROMPT_TOKENS + 3 for r in done)

    def delta(series: str) -> float:
        return metric(after, series, model_name=name) - metric(before, series, model_name=name)

    assert delta("vllm:prompt_tokens_total") == sum(r["prompt_tokens"] for r in done)
    assert delta("vllm:generation_tokens_total") == sum(r["output_tokens"] for r in done)
    assert delta("vllm:request_success_total") == REQUESTS
