"""deploy/kubernetes/pd: the prefill and decode Deployments for llm-d (docs/disaggregation.md),
validated offline: both against the Kubernetes schemas (strict), llm-d's role labels on the
pods and their selectors, and each tokenloom command line a valid config with the
kv_transfer role of its Deployment (the prefill pod announcing its kv-transfer port)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

PD = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "pd" / "tokenloom-pd.yaml"


def deployments() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all(PD.read_text()) if d]
    return {d["metadata"]["labels"]["llm-d.ai/role"]: d for d in docs
            if d["kind"] == "Deployment"}


def tokenloom_config(deployment: dict):
    from tokenloom.config.load import load_config
    from tokenloom.daemon.__main__ import _parse_set, build_parser
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
            if c["name"] == "tokenloom"]
    args = build_parser().parse_args(c["command"][1:])
    return c, load_config(overrides=_parse_set(args.set), env=None)


def test_one_prefill_and_one_decode_deployment_match_the_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    found = deployments()
    assert set(found) == {"prefill", "decode"}
    for d in found.values():
        kubernetes_validate.validate(d, "1.31.0", strict=True)
        role = d["metadata"]["labels"]["llm-d.ai/role"]
        assert d["spec"]["selector"]["matchLabels"]["llm-d.ai/role"] == role
        assert d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/role"] == role


def test_commands_carry_the_kv_transfer_role():
    found = deployments()
    c, config = tokenloom_config(found["prefill"])
    assert config.kv_transfer.role == "prefill" and config.kv_transfer.port
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["kv-transfer"] == config.kv_transfer.port
    assert config.kv_transfer.advertise_host
    c, config = tokenloom_config(found["decode"])
    assert config.kv_transfer.role == "decode" and config.kv_transfer.port
    sidecar = [x for x in found["decode"]["spec"]["template"]["spec"]["containers"]
               if x["name"] == "routing-sidecar"][0]
    port = c["command"][c["command"].index("--port") + 1]
    assert f"--vllm-port={port}" in sidecar["args"]   # the sidecar forwards to tokenloom
    assert "--connector=nixlv2" in sidecar["args"]
