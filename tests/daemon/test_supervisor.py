"""systemd's watchdog restarts a daemon whose engine died: tested with a stand-in supervisor.

This machine has no systemd user manager (`systemd-run --user` needs one), so `Supervisor`
plays the part of the unit's `Type=notify` + `WatchdogSec=` + `Restart=on-failure`: it
passes $NOTIFY_SOCKET and $WATCHDOG_USEC, waits for READY=1, and when no WATCHDOG=1 arrives
for WatchdogSec it kills the daemon with SIGABRT (as systemd does) and starts it again.
The manual check on a systemd host is in docs/operations.md ("Restart under systemd").

1. `tokenloom serve` (tiny model, with the test-only fault hook armed from the environment)
   sends READY=1 and WATCHDOG=1 pings;
2. a request from the victim tenant kills the KV manager actor: the client gets an error,
   /health turns 503, and the pings stop;
3. the supervisor's watchdog fires: SIGABRT, exit by signal, a restart;
4. the new process sends READY=1, /health is 200 and a request is served.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from client import get, post
from notify_listener import NotifyListener
from servers import ServerProcess, wait_for

TESTS = Path(__file__).resolve().parents[1]
BOOT = ("import sys, faults; faults.install_from_env(); "
        "from tokenloom.daemon.__main__ import main; sys.exit(main(sys.argv[1:]))")
WATCHDOG_SECONDS = 2.0


class Supervisor:
    def __init__(self, args: list[str], env: dict, listener: NotifyListener):
        self.args, self.env, self.listener = args, env, listener
        self.restarts = 0
        self.exit_codes: list[int] = []
        self.start()

    def start(self) -> None:
        self.listener.clear()
        self.server = ServerProcess(
            *self.args, command=(sys.executable, "-c", BOOT), timeout=120,
            env={**self.env, "NOTIFY_SOCKET": self.listener.address,
                 "WATCHDOG_USEC": str(int(WATCHDOG_SECONDS * 1e6))})
        self.proc = self.server.proc
        assert wait_for(lambda: self.listener.count("READY=1") == 1, 120), \
            "no READY=1:\n" + "\n".join(self.server.lines[-20:])
        self.url = self.server.url

    def watch(self, timeout: float) -> bool:
        """Watch the pings like systemd; True once the watchdog fired and a restart began."""
        deadline = time.monotonic() + timeout
        last_count, last_ping = self.listener.count("WATCHDOG=1"), time.monotonic()
        while time.monotonic() < deadline:
            count = self.listener.count("WATCHDOG=1")
            if count != last_count:
                last_count, last_ping = count, time.monotonic()
            elif time.monotonic() - last_ping > WATCHDOG_SECONDS:
                self.proc.send_signal(signal.SIGABRT)   # systemd's WatchdogSignal
                self.exit_codes.append(self.proc.wait(30))
                self.restarts += 1
                self.start()                             # Restart=on-failure
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self.server.stop()


def test_watchdog_restarts_a_daemon_whose_engine_died(tiny_model_dir, tmp_path, model_name):
    listener = NotifyListener(str(tmp_path / "notify.sock"))
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath,
           "TOKENLOOM_FAULT_INJECTION": "1",
           "TOKENLOOM_FAULTS": json.dumps([{"point": "kv_actor", "tenant": "victim"}])}
    args = ["--model", str(tiny_model_dir), "--set", "model.device=\"cpu\"",
            "--set", "model.dtype=\"float32\"", "--set", f"model.cache_dir=\"{tmp_path}\"",
            "--set", "cache.num_blocks=256", "--set", "admin.enabled=false"]
    sup = Supervisor(args, env, listener)
    try:
        # 1. healthy: pings flow, requests are served
        assert wait_for(lambda: listener.count("WATCHDOG=1") >= 2, 30)
        body = dict(model=model_name, prompt="w5 w6", max_tokens=4)
        assert post(sup, "/v1/completions", body)[0] == 200
        assert not sup.watch(timeout=2 * WATCHDOG_SECONDS)   # no restart while healthy
        # 2. the victim kills the KV manager actor
        status, reply = post(sup, "/v1/completions", {**body, "user": "victim"})
        assert status in (500, 503) and "error" in reply
        status, reply = get(sup, "/health")
        assert status == 503 and "stopped" in reply["error"]["message"]
        # 3. the watchdog fires and the daemon is restarted
        assert sup.watch(timeout=60), "the pings never stopped"
        assert sup.exit_codes == [-signal.SIGABRT]
        # 4. the new process serves
        assert get(sup, "/health")[0] == 200
        assert post(sup, "/v1/completions", body)[0] == 200
        assert wait_for(lambda: listener.count("WATCHDOG=1") >= 1, 30)
    finally:
        sup.stop()
        listener.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
