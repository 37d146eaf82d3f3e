"""deploy/kubernetes: the manifests a user applies to run tokenloom behind an inference
gateway, validated offline.
1. Deployment and Service against the Kubernetes API schemas (kubernetes-validate's
   bundled, strict: unknown fields fail);
2. the InferencePool against the required shape of inference.networking.k8s.io/v1
   (selector.matchLabels, 1-8 targetPorts, endpointPickerRef name and port), as the
   Gateway API Inference Extension's API reference defines it;
3. the pieces agree: the pool and the Service select the Deployment's pods, the pool's
   target port is the container's http port, the probes and the metrics the picker
   scrapes are routes the server has, and the container's command line parses and
   loads as a valid tokenloom config (every --set key exists and is in range).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.31.0"


def docs() -> list[dict]:
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def by_kind(kind: str) -> dict:
    found = [d for d in docs() if d["kind"] == kind]
    assert len(found) == 1, f"one {kind} expected, found {len(found)}"
    return found[0]


@pytest.mark.parametrize("kind", ["Deployment", "Service"])
def test_core_objects_match_the_kubernetes_schema(kind):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(by_kind(kind), K8S_VERSION, strict=True)


PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
        "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object", "required": ["matchLabels"], "additionalProperties": False,
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1,
                        "additionalProperties": {"type": "string"}}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": PORT},
                "endpointPickerRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string", "minLength": 1},
                        "port": PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]}}},
            },
        },
    },
}


def test_inference_pool_has_the_v1_shape():
    jsonschema.validate(by_kind("InferencePool"), INFERENCE_POOL_V1)
    # the guard works: a pool without a target port is refused
    broken = by_kind("InferencePool")
    broken["spec"]["targetPorts"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, INFERENCE_POOL_V1)


def test_the_pieces_agree():
    deploy, service, pool = by_kind("Deployment"), by_kind("Service"), by_kind("InferencePool")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    probes = {container[k]["httpGet"]["path"]
              for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes == {"/health", "/ready"}


def test_probe_and_metrics_paths_are_server_routes(tmp_path):
    from tokenloom.config.load import load_config
    from tokenloom.daemon.app import create_app
    app = create_app(load_config(overrides={"admin.enabled": False}, env=None))
    paths = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    assert {"/health", "/ready", "/metrics"} <= paths


def test_the_container_command_is_a_valid_tokenloom_config():
    from tokenloom.config.load import load_config
    from tokenloom.daemon.__main__ import _parse_set, build_parser
    container = by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]
    argv = [a.replace("$(POD_IP)", "10.0.0.7") for a in container["command"]]
    assert argv[0] == "tokenloom", shlex.join(argv)
    args = build_parser().parse_args(argv[1:])
    config = load_config(overrides=_parse_set(args.set), env=None)
    assert config.model.device == "cuda"
    assert config.kv_events.enable_kv_cache_events
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert config.kv_events.endpoint.endswith(f":{ports['kv-events']}")
    assert config.kv_events.replay_endpoint.endswith(f":{ports['kv-replay']}")
    assert args.port == ports["http"]


def test_the_endpoint_picker_config_agrees_with_the_pods():
    """llm-d's EPP config (epp-config.yaml): its token producer renders through the
    tokenloom Service with a model name the pods serve, its KV-event subscriber reaches the
    pods' event and replay ports, and its block size is the pods' cache.block_size."""
    from tokenloom.config.load import load_config
    from tokenloom.daemon.__main__ import _parse_set, build_parser

    epp = yaml.safe_load(by_kind("ConfigMap")["data"]["epp-config.yaml"])
    assert epp["kind"] == "EndpointPickerConfig"
    plugins = {p["type"]: p.get("parameters", {}) for p in epp["plugins"]}
    deploy, service = by_kind("Deployment"), by_kind("Service")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    argv = [a.replace("$(POD_IP)", "10.0.0.7") for a in container["command"]]
    config = load_config(overrides=_parse_set(build_parser().parse_args(argv[1:]).set), env=None)
    producer = plugins["token-producer"]
    assert producer["modelName"] == config.server.served_model_name
    assert config.kv_events.topic.endswith("@" + producer["modelName"])
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert producer["vllm"]["url"] == f"http://{service['metadata']['name']}:{http['port']}"
    precise = plugins["precise-prefix-cache-producer"]
    assert precise["tokenProcessorConfig"]["blockSize"] == config.cache.block_size
    discovery = precise["kvEventsConfig"]["podDiscoveryConfig"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert discovery["socketPort"] == ports["kv-events"]
    assert discovery["replaySocketPort"] == ports["kv-replay"]
    key, value = discovery["podLabelSelector"].split("=")
    assert deploy["spec"]["template"]["metadata"]["labels"][key] == value
    assert config.kv_events.topic.startswith(precise["kvEventsConfig"]["topicFilter"])
    scored = {p["pluginRef"] for prof in epp["schedulingProfiles"] for p in prof["plugins"]}
    assert scored <= set(plugins)
