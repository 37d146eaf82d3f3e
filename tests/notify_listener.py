"""A stand-in for systemd's notification socket: a real AF_UNIX datagram socket (a path, or
an abstract name) read by a background thread, keeping every `KEY=VALUE` line in order."""

from __future__ import annotations

import os
import socket
import threading
import uuid


class NotifyListener:
    def __init__(self, path: str | None = None):
        """`path`: a filesystem socket; None: a fresh abstract socket (`@name`)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if path is None:
            name = f"tokenloom-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.sock.bind("\0" + name)
            self.address = "@" + name     # the $NOTIFY_SOCKET spelling
        else:
            self.sock.bind(path)
            self.address = path
        self.sock.settimeout(0.1)
        self.datagrams: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self.datagrams.append(data.decode())

    def lines(self) -> list[str]:
        """Every line of every datagram, in arrival order."""
        with self._lock:
            return [line for d in self.datagrams for line in d.split("\n")]

    def count(self, line: str) -> int:
        return self.lines().count(line)

    def clear(self) -> None:
        with self._lock:
            self.datagrams.clear()

    def env(self, watchdog_usec: int | None = None) -> dict[str, str]:
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
