"""sd_notify against a real AF_UNIX datagram socket: the Notifier alone (path and abstract
sockets, the watchdog interval, a vanished manager), then a real `tokenloom serve` process
whose notifications must arrive in the order systemd expects."""

from __future__ import annotations

import os

import pytest

from tokenloom.daemon.sdnotify import Notifier, socket_address, watchdog_interval

from notify_listener import NotifyListener
from servers import ServerProcess, wait_for


@pytest.fixture
def listener(tmp_path):
    lst = NotifyListener(str(tmp_path / "notify.sock"))
    yield lst
    lst.close()


def test_without_notify_socket_everything_is_a_no_op():
    n = Notifier.from_env({})
    assert not n.enabled and n.watchdog_seconds is None
    assert n.ready("x") is False and n.watchdog() is False and n.stopping() is False


def test_path_socket_receives_each_notification(listener):
    n = Notifier.from_env(listener.env())
    assert n.enabled
    assert n.status("loading model") and n.ready("serving on :8000") and n.watchdog()
    assert n.stopping("draining (SIGTERM)")
    assert wait_for(lambda: len(listener.datagrams) == 4)
    assert listener.datagrams == ["STATUS=loading model", "READY=1\nSTATUS=serving on :8000",
                                  "WATCHDOG=1", "STOPPING=1\nSTATUS=draining (SIGTERM)"]
    n.close()


def test_abstract_socket():
    lst = NotifyListener()  # "@name"
    try:
        assert lst.address.startswith("@")
        n = Notifier.from_env(lst.env())
        assert n.ready()
        assert wait_for(lambda: lst.lines() == ["READY=1"])
        n.close()
    finally:
        lst.close()


def test_status_is_one_line(listener):
    n = Notifier.from_env(listener.env())
    n.status("two\nlines  and\tspace")
    assert wait_for(lambda: listener.lines() == ["STATUS=two lines and space"])
    n.close()


def test_a_vanished_manager_never_raises(tmp_path):
    n = Notifier(str(tmp_path / "gone.sock"))
    assert n.ready() is False and n.watchdog() is False  # ENOENT, swallowed (and logged once)


def test_addresses_and_watchdog_interval():
    assert socket_address("@sd") == "\0sd"
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("vsock:2:1") is None and socket_address("@") is None
    assert watchdog_interval({"WATCHDOG_USEC": "200000"}) == pytest.approx(0.1)
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}) \
        == pytest.approx(0.1)
    assert watchdog_interval({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({}) is None
    assert Notifier.from_env({"WATCHDOG_USEC": "200000"}).watchdog_seconds is None  # no socket


def test_from_env_unsets_the_variables(monkeypatch, listener):
    monkeypatch.setenv("NOTIFY_SOCKET", listener.address)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    n = Notifier.from_env(unset=True)
    assert n.enabled and n.watchdog_seconds == pytest.approx(0.5)
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ


def test_daemon_notifies_in_order(tiny_model_dir, tmp_path, listener):
    """1. the daemon starts with $NOTIFY_SOCKET (a path socket) and WATCHDOG_USEC=200000;
    2. STATUS= lines arrive during start-up, then READY=1 once it serves;
    3. WATCHDOG=1 pings keep coming (every 0.1 s);
    4. SIGTERM: STOPPING=1 arrives, then drain STATUS lines; the process exits 0."""
    server = ServerProcess("--model", str(tiny_model_dir), "--set", "model.device=cpu",
                           "--set", f'model.cache_dir="{tmp_path}"', "--set",
                           "cache.num_blocks=64", "--set", "model.num_threads=1",
                           "--set", "admin.enabled=false",
                           env=listener.env(watchdog_usec=200_000))
    try:
        assert wait_for(lambda: "READY=1" in listener.lines(), timeout=30)
        ready = listener.lines().index("READY=1")
        assert wait_for(lambda: listener.lines()[ready:].count("WATCHDOG=1") >= 3, timeout=30)
    finally:
        code = server.stop()
    assert code == 0, "\n".join(server.lines[-20:])
    lines = listener.lines()
    ready, stopping = lines.index("READY=1"), lines.index("STOPPING=1")
    assert lines.count("READY=1") == 1 and lines.count("STOPPING=1") == 1
    startup = [x for x in lines[:ready] if x.startswith("STATUS=")]
    assert any("loading model" in x for x in startup), startup
    assert "STATUS=warming up" in startup
    assert ready < stopping
    assert lines[ready + 1].startswith("STATUS=serving on http://127.0.0.1:")
    assert lines[ready:stopping].count("WATCHDOG=1") >= 3
    assert any(x.startswith("STATUS=draining") for x in lines[stopping:])
    assert lines[-1].startswith("STATUS=stopping")
