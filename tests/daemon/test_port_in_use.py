"""`tokenloom serve` on a port another process already listens on:

1. a real socket listens on 127.0.0.1:P;
2. `tokenloom serve --port P` exits with status 2 and one stderr line naming 127.0.0.1:P and
   the fix (--port);
3. it never loaded the model: no start-up log line, and the model cache directory was never
   created (the tiny model would have been converted into it).
"""

from __future__ import annotations

import socket
import subprocess

from servers import TOKENLOOM


def test_serve_on_an_occupied_port_exits_2_before_loading(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [TOKENLOOM, "serve", "--host", "127.0.0.1", "--port", str(port),
             "--model", str(tiny_model_dir), "--set", "model.device=cpu",
             "--set", f"model.cache_dir={cache}"],
            capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port} is already in use" in lines[0] and "--port" in lines[0]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert not cache.exists()


def test_bind_problem_names_the_address_only_when_it_is_taken():
    from tokenloom.daemon.connections import bind_problem

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        busy.listen()
        assert f"127.0.0.1:{port}" in bind_problem("127.0.0.1", port)
    assert bind_problem("127.0.0.1", port) is None           # closed again
    assert bind_problem("127.0.0.1", 0) is None
