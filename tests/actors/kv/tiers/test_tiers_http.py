"""The KV tiers through the HTTP server: /metrics series, /health while a tier is down,
the metrics object's per-tier cached tokens, and `tokenloom admin stats`."""

from __future__ import annotations

import pytest

from tinymodel import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tiers-http")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2), seed=7)
    return path


def test_tiers_over_http_metrics_health_and_admin(model_dir, tmp_path, redis_server):
    import time

    from tokenloom.daemon.admin import cli as admin_cli
    from tokenloom.daemon.admin import protocol as P

    from client import get, metric, metrics, post
    from servers import ServerThread, tiny_config

    cfg = tiny_config(model_dir, tmp_path / "cache", **{
        "cache.num_blocks": 24, "scheduler.max_num_seqs": 2,
        "admin.socket_path": str(tmp_path / "admin.sock"),
        "kv_tiers.enabled": True, "kv_tiers.host_bytes": 1 << 24,
        "kv_tiers.remote_url": redis_server.url, "kv_tiers.remote_write": "through",
        "kv_tiers.remote_retry_after_s": 0.2})
    server = ServerThread(cfg)
    try:
        prompts = [" ".join(f"w{5 + (i * 11 + k) % 150}" for k in range(40)) for i in range(6)]

        def complete(prompt):
            status, body = post(server, "/v1/completions", {
                "model": model_dir.name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "return_metrics": True})
            assert status == 200, body
            return body

        first = [complete(p) for p in prompts]
        second = [complete(p) for p in prompts]
        assert [b["choices"][0]["text"] for b in first] == \
            [b["choices"][0]["text"] for b in second]
        by_tier = [b["metrics"]["prefix_cache"][0].get("cached_tokens_by_tier") or {}
                   for b in second]
        assert any(t.get("host") for t in by_tier), by_tier
        for b, t in zip(second, by_tier):   # exact: the usage figure is their sum
            assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == sum(t.values())
        text = metrics(server)
        assert metric(text, "tokenloom:kv_tier_hits_total", tier="host") > 0
        assert metric(text, "tokenloom:kv_tier_queries_total", tier="remote") > 0
        assert metric(text, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") > 0
        assert metric(text, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") > 0
        assert metric(text, "tokenloom:kv_tier_usage_bytes", tier="host") > 0
        assert metric(text, "tokenloom:kv_tier_regret_seconds_bucket", le="+Inf") > 0
        assert metric(text, "tokenloom:kv_tier_degraded", tier="remote") == 0
        assert get(server, "/health")[0] == 200
        reply = admin_cli.send(cfg.admin.socket_path, P.Stats(), timeout=30)
        rendered = admin_cli.render(reply)
        assert "KV tier host" in rendered and "KV tier remote" in rendered, rendered
        # The remote server goes away: /health says which tier is degraded, requests go on.
        redis_server.kill()
        complete(prompts[0] + " w7")
        time.sleep(0.3)
        complete(prompts[1] + " w8")
        status, body = get(server, "/health")
        assert status == 200 and body["status"] == "degraded" and "remote" in body["kv_tiers"]
        assert metric(metrics(server), "tokenloom:kv_tier_degraded", tier="remote") == 1
        redis_server.restart()
        time.sleep(0.4)
        complete(prompts[2] + " w9")
        server.wait_idle()
        time.sleep(0.4)
        assert get(server, "/health")[0] == 200
        assert metric(metrics(server), "tokenloom:kv_tier_degraded", tier="remote") == 0
    finally:
        server.close()
