"""systemd/tokenloom.service: `systemd-analyze verify` accepts it, and it says what the
operations design asks for (Type=notify, watchdog, drain-aware stop timeout, hardening,
GPU-only devices). systemd/config.toml loads as a valid config consistent with the unit."""

from __future__ import annotations

import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from tokenloom.config.load import load_config

from servers import TOKENLOOM

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "tokenloom.service"
EXAMPLE_CONFIG = ROOT / "systemd" / "config.toml"
INSTALLED = "/opt/tokenloom/.venv/bin/tokenloom"


def unit() -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value (systemd keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        section.setdefault(key.strip(), []).append(value.strip())
    return out


def one(key: str, section: str = "Service") -> str:
    (value,) = unit()[section][key]
    return value


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+)(s|min)?", value)
    assert m, f"unsupported time span {value!r}"
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def _skip(reason: str) -> None:
    # A warning too: `pytest -q` lists warnings in its summary, not skip reasons.
    warnings.warn(f"systemd/tokenloom.service NOT verified: {reason}")
    pytest.skip(reason)


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        _skip("systemd-analyze is not installed (apt-get install systemd)")
    # verify checks that ExecStart's binary exists: point it at this checkout's install.
    text = UNIT.read_text()
    assert INSTALLED in text
    copy = tmp_path / "tokenloom.service"
    copy.write_text(text.replace(INSTALLED, TOKENLOOM))
    p = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    if p.returncode != 0 and "Failed to" in p.stderr and "tokenloom.service" not in p.stderr:
        _skip(f"systemd-analyze cannot run here: {p.stderr.strip()[:300]}")
    assert p.returncode == 0, p.stderr
    problems = [line for line in p.stderr.splitlines() if "tokenloom.service" in line]
    assert not problems, p.stderr


def test_unit_is_a_notify_service_with_watchdog_and_drain_aware_stop():
    assert one("Type") == "notify"
    assert one("ExecStart") == f"{INSTALLED} serve --config /etc/tokenloom/config.toml"
    assert one("KillSignal") == "SIGTERM" and one("Restart") == "on-failure"
    assert one("RuntimeDirectory") == "tokenloom"
    assert one("User") == "tokenloom" and one("Group") == "tokenloom"
    cfg = load_config(EXAMPLE_CONFIG, env=None)
    # The stop timeout covers the drain, the handlers' grace period, HTTP shutdown and the
    # engine's own stop (daemon.drain / app.engine_ctx): 10 + 5 + 30 seconds past the drain.
    assert seconds(one("TimeoutStopSec")) > cfg.server.drain_timeout_seconds + 45
    # Pings stop health_stall_seconds into a wedge; systemd restarts WatchdogSec later.
    assert seconds(one("WatchdogSec")) > cfg.server.health_stall_seconds
    assert seconds(one("TimeoutStartSec")) >= 300  # model load + graph capture


def test_unit_hardening_and_gpu_only_devices():
    service = unit()["Service"]
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes"),
                       ("DevicePolicy", "closed")]:
        assert service[key] == [value], key
    devices = [d.split()[0] for d in service["DeviceAllow"]]
    assert devices and all(d.startswith("/dev/nvidia") for d in devices), devices
    assert "PrivateDevices" not in service  # it would hide the GPU


def test_example_config_is_valid_and_matches_the_unit():
    cfg = load_config(EXAMPLE_CONFIG, env=None)
    assert cfg.admin.socket_path == "/run/tokenloom/admin.sock"  # under RuntimeDirectory=
    assert cfg.model.device == "cuda"
    assert cfg.model.cache_dir.startswith("/var/cache/tokenloom")  # CacheDirectory=
    assert "CacheDirectory" in unit()["Service"]
