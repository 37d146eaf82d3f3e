"""systemd/tokenloom@.service, one daemon per GPU: `systemd-analyze verify` accepts an
instance of it; instance N gets GPU N (model.device cuda:N, only /dev/nvidiaN allowed), port
800N and its own admin socket; and it is otherwise the single-GPU unit (same hardening,
notify, watchdog and drain settings), so the two cannot drift apart."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from tokenloom.config.load import load_config
from tokenloom.config.schema import ConfigError

from servers import TOKENLOOM

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "systemd" / "tokenloom@.service"
SINGLE = ROOT / "systemd" / "tokenloom.service"
INSTALLED = "/opt/tokenloom/.venv/bin/tokenloom"


def entries(path: Path) -> list[tuple[str, str]]:
    out = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def instance(n: int) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key, value in entries(TEMPLATE):
        out.setdefault(key, []).append(value.replace("%i", str(n)))
    return out


def test_systemd_analyze_verify_an_instance(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        warnings.warn("systemd/tokenloom@.service NOT verified: no systemd-analyze")
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    (tmp_path / "tokenloom@.service").write_text(
        TEMPLATE.read_text().replace(INSTALLED, TOKENLOOM))
    p = subprocess.run([tool, "verify", "./tokenloom@1.service"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    if p.returncode != 0 and "tokenloom@" not in p.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {p.stderr.strip()[:300]}")
    problems = [line for line in p.stderr.splitlines() if "tokenloom@" in line]
    assert p.returncode == 0 and not problems, p.stderr


def test_instance_n_owns_gpu_n():
    for n in (0, 3):
        unit = instance(n)
        env = dict(e.split("=", 1) for e in unit["Environment"] if "TOKENLOOM_" in e)
        assert env["TOKENLOOM_MODEL__DEVICE"] == f"cuda:{n}"
        assert unit["ExecStart"][0].endswith(f"--port 800{n}")
        gpus = [d for d in unit["DeviceAllow"] if d.split()[0].rstrip("0123456789")
                == "/dev/nvidia" and d.split()[0] != "/dev/nvidiactl"]
        assert gpus == [f"/dev/nvidia{n} rw"], unit["DeviceAllow"]
        assert unit["RuntimeDirectory"] == [f"tokenloom-{n}"]
        assert env["TOKENLOOM_ADMIN__SOCKET_PATH"] == f"/run/tokenloom-{n}/admin.sock"
        # what the daemon does with that environment: a valid config for GPU n
        config = load_config(str(ROOT / "systemd" / "config.toml"), env=env)
        assert config.model.device == f"cuda:{n}"


def test_the_template_is_the_single_gpu_unit_apart_from_the_instance_keys():
    per_instance = {"Description", "Environment", "EnvironmentFile", "ExecStart",
                    "RuntimeDirectory", "SyslogIdentifier", "DeviceAllow"}
    single = [e for e in entries(SINGLE) if e[0] not in per_instance]
    template = [e for e in entries(TEMPLATE) if e[0] not in per_instance]
    assert single == template


def test_device_index_is_validated():
    assert load_config(overrides={"model.device": "cuda:7"}, env=None).model.device == "cuda:7"
    with pytest.raises(ConfigError, match=r"model.device must be auto, cpu, cuda or cuda:N"):
        load_config(overrides={"model.device": "cuda:one"}, env=None)


def test_a_missing_gpu_is_a_config_error(monkeypatch):
    import torch

    from tokenloom.kernels.device import pick_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'cuda:1' but no CUDA device"):
        pick_device("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    with pytest.raises(ConfigError, match=r"has 2 CUDA device\(s\), cuda:0..cuda:1"):
        pick_device("cuda:2")
    assert pick_device("cuda:1") == torch.device("cuda:1") and chosen == [torch.device("cuda:1")]
