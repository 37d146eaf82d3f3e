"""`tokenloom serve` as a real subprocess on 127.0.0.1, for client tests.

The server binds port 0 (any free port); its JSON log line {"event": "listening", "port": N}
tells the port. Every stderr line is kept (`lines`) for log assertions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

TOKENLOOM = str(Path(sys.executable).with_name("tokenloom"))


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 120.0, env: dict | None = None):
        cmd = [TOKENLOOM, "serve", "--host", "127.0.0.1", "--port", "0", *args]
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=full_env, text=True)
        self.lines: list[str] = []
        self._port: int | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or self._port is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines[-30:]))
        self.url = f"http://127.0.0.1:{self._port}"

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self._port is None:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "listening":
                    self._port = event["port"]
                    self._ready.set()
        self._ready.set()  # exited before listening

    def json_lines(self) -> list[dict]:
        """Log lines (JSON objects); anything else on stderr (library warnings) is skipped."""
        out = []
        for line in self.lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)
        return self.proc.returncode


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
