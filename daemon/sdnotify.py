"""sd_notify(3) for `Type=notify` services, without libsystemd.

systemd passes `$NOTIFY_SOCKET`: a path (`/run/systemd/notify`) or an abstract socket name
written with a leading `@`. Each notification is one datagram of `KEY=VALUE` lines. With
`WatchdogSec=` it also passes `$WATCHDOG_USEC` (and `$WATCHDOG_PID`): the service must send
`WATCHDOG=1` more often than that; we ping at half the interval.

Contract: every method is a no-op when `$NOTIFY_SOCKET` was unset, and never raises — a
service manager that went away must not take the daemon down with it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger("tokenloom.sdnotify")


def socket_address(value: str) -> str | None:
    """The AF_UNIX address for a `$NOTIFY_SOCKET` value, or None if unsupported.
    `@name` is the abstract socket `\\0name`; an absolute path is a path socket."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # e.g. systemd's vsock: addresses, which this host does not use


def watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of `$WATCHDOG_USEC`), or None when the
    watchdog is off or meant for another process (`$WATCHDOG_PID`)."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2 / 1e6


class Notifier:
    """Sends notifications to the service manager; see the module docstring."""

    def __init__(self, address: str | None = None, watchdog_seconds: float | None = None):
        self.address = address
        self.watchdog_seconds = watchdog_seconds
        self._sock: socket.socket | None = None
        self._warned = False
        if address is not None:  # now, not lazily: start-up messages come from two threads
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # systemd reads promptly; a bounded wait rides out a briefly full queue
            # (READY=1 must not be lost) without ever stalling the event loop for long.
            self._sock.settimeout(1.0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, unset: bool = False) -> "Notifier":
        """From `$NOTIFY_SOCKET`/`$WATCHDOG_USEC`. `unset` removes them from os.environ so
        that child processes (compilers, tokenizer workers) cannot notify on our behalf."""
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        address = socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("unsupported NOTIFY_SOCKET; not notifying", notify_socket=raw)
        notifier = cls(address, watchdog_interval(env) if address else None)
        if unset:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *lines: str) -> bool:
        """Send `KEY=VALUE` lines as one datagram; True if it was sent."""
        if self.address is None or self._sock is None:  # disabled, or closed
            return False
        try:
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as e:
            if not self._warned:  # once: the manager may be gone for good
                log.warning("sd_notify failed", error=repr(e))
                self._warned = True
            return False

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, text: str) -> bool:
        return self.notify(*_status(text))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status(text: str | None) -> tuple[str, ...]:
    # One line per STATUS: a newline would start a new (bogus) assignment.
    return () if text is None else ("STATUS=" + " ".join(text.split()),)
