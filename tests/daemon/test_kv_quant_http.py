"""A daemon serving from a quantized KV cache: /metrics and admin stats say how K/V are
stored, what a token costs, and what the runtime quality check has seen."""

from __future__ import annotations

import re

import aiohttp
import pytest

from tokenloom.daemon.admin import cli as admin_cli
from tokenloom.daemon.admin import protocol as P


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from servers import ServerThread, tiny_config

    tmp = tmp_path_factory.mktemp("kvq")
    cfg = tiny_config(tiny_model_dir, tmp / "cache",
                      **{"admin.socket_path": str(tmp / "admin.sock"), "cache.kv_dtype": "int8",
                         "cache.force_kv_dtype": True, "cache.kv_check_fraction": 0.5})
    s = ServerThread(cfg)
    yield s
    s.close()


async def test_metrics_and_admin_stats_show_the_kv_storage(server, tiny_model_dir):
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/v1/completions", json=dict(
                model=str(tiny_model_dir), prompt="w5 w6 w7 w8 w9 w10 w11 w12 w13",
                max_tokens=12, temperature=0, ignore_eos=True)) as r:
            assert r.status == 200, await r.text()
        server.wait_idle()
        server.engine.runner.kv_quant_snapshot = \
            server.engine.runner.model_runner.kv_quant_stats(*server.engine.runner.kv_quant_labels)
        async with session.get(server.url + "/metrics") as r:
            text = await r.text()
    spec = server.engine.info.spec
    per_token = spec.num_layers * 2 * spec.num_kv_heads * (spec.head_dim + 4)
    assert re.search(r'^tokenloom:kv_cache_dtype_info\{.*kv_dtype="int8".*\} 1\.0$', text, re.M)
    assert re.search(rf"^tokenloom:kv_cache_bytes_per_token\{{.*\}} {per_token}\.0$", text, re.M)
    assert re.search(r'^vllm:cache_config_info\{.*cache_dtype="int8".*\} 1\.0$', text, re.M)
    checked = re.search(r"^tokenloom:kv_quant_check_steps_total\{.*\} (\d+)\.0$", text, re.M)
    assert checked and int(checked.group(1)) >= 4          # every 2nd of 11 decode steps
    assert re.search(r"^tokenloom:kv_quant_check_alarms_total\{.*\} 0\.0$", text, re.M)
    assert re.search(r"^tokenloom:kv_quant_promoted_layers\{.*\} 0\.0$", text, re.M)
    reply = admin_cli.send(server.engine.config.admin.socket_path, P.Stats(), timeout=30)
    assert reply.engine.kv_quant.kv_dtype == "int8"
    rendered = admin_cli._render_stats(reply)
    assert re.search(rf"KV storage\s+int8, {per_token} bytes/token, hadamard rotation; "
                     r"quality check every 2 "
                     r"decode steps: \d+ checked, 0 alarms", rendered), rendered
