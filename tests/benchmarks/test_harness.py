"""benchmarks/harness.py, what every benchmark script shares:
1. the load generator's client reads a real HTTP/1.1 SSE stream (a stand-in server on
   127.0.0.1 that streams OpenAI-shaped chunks, chunked, keep-alive) and `summarise` counts
   its tokens, TTFT, inter-token gaps and errors;
2. `percentile` is numpy's, None without samples; `write_json` makes the folders;
3. a server that exits before it is ready is a ServerError with its exit status, and a
   ready one is stopped by SIGTERM;
4. every script under benchmarks/ answers --help (none reaches into another through
   sys.path inserts any more, and all of them still import).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402


class _SSEServer:
    """A stand-in completions server: `tokens` content chunks, then a usage chunk and
    [DONE]; a prompt "bad" gets a 400 JSON error."""

    def __init__(self, tokens: int):
        from aiohttp import web

        async def completions(request):
            body = await request.json()
            if body["prompt"] == "bad":
                return web.json_response({"error": {"message": "bad prompt"}}, status=400)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(tokens):
                chunk = {"choices": [{"index": 0, "text": f"w{i}"}]}
                await resp.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode()
                                 + b"\n\n")
                await asyncio.sleep(0.001)
            usage = {"choices": [], "usage": {"completion_tokens": tokens,
                                             "prompt_tokens_details": {"cached_tokens": 8}}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_the_load_generator_reads_a_real_sse_stream_and_summarises_it():
    server = _SSEServer(tokens=5)
    try:
        prompts = ["w1 w2"] * 6 + ["bad"]
        results, elapsed = asyncio.run(harness.run_load(server.url, "m", prompts, 5, 3, 0, 0))
    finally:
        server.close()
    assert len(results) == 7
    ok = [r for r in results if "error" not in r]
    assert len(ok) == 6 and all(r["tokens"] == 5 and len(r["itl"]) == 4 for r in ok)
    assert all(r["ttft"] is not None and r["ttft"] <= r["e2e"] for r in ok)
    assert all(r["cached_tokens"] == 8 for r in ok)
    s = harness.summarise(results, elapsed)
    assert s["requests"] == 7 and s["errors"] == 1 and s["output_tokens"] == 30
    assert s["first_error"].startswith("400 ") and "bad prompt" in s["first_error"]
    assert s["ttft_hit_ms"]["n"] == 6 and s["ttft_miss_ms"]["n"] == 0
    assert s["itl_ms"]["p50"] <= s["itl_ms"]["p99"]


def test_percentile_and_write_json(tmp_path, capsys):
    xs = [3.0, 1.0, 2.0, 10.0]
    assert harness.percentile(xs, 50) == float(np.percentile(xs, 50)) == 2.5
    assert harness.percentile(xs, 99, 1000) == pytest.approx(np.percentile(xs, 99) * 1000)
    assert harness.percentile([], 50) is None
    path = harness.write_json(tmp_path / "a" / "b.json", {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1}
    harness.print_table("run", harness.summarise([{"error": "500 x"}], 1.0))
    assert "1 errors" in capsys.readouterr().out


def test_a_server_that_exits_early_is_an_error_with_its_status(tmp_path):
    with pytest.raises(harness.ServerError) as e:
        harness.Server("the stand-in", [sys.executable, "-c", "import sys; sys.exit(3)"],
                       f"http://127.0.0.1:{harness.free_port()}", "/ready", timeout=60,
                       log_path=tmp_path / "log")
    assert e.value.returncode == 3 and "exited with status 3" in str(e.value)


def test_a_ready_server_stops_on_sigterm():
    port = harness.free_port()
    code = ("import http.server, signal, sys\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
            f"http.server.HTTPServer(('127.0.0.1', {port}), "
            "http.server.SimpleHTTPRequestHandler).serve_forever()\n")
    with harness.Server("http.server", [sys.executable, "-c", code],
                        f"http://127.0.0.1:{port}", "/", timeout=60, cwd="/") as server:
        assert server.proc.poll() is None
    assert server.proc.returncode == 0


# Modules the scripts import, not scripts themselves.
LIBRARIES = {"harness.py", "records.py"}


def test_every_benchmark_script_answers_help():
    """Modules without a command line of their own (gpu_engine, gpu_mixed: gpu_check's
    parts; interference: serve.py --interference) must still import and exit 0."""
    scripts = sorted(p for p in BENCH.glob("*.py") if p.name not in LIBRARIES)
    assert len(scripts) >= 15
    from concurrent.futures import ThreadPoolExecutor

    def answer(script):
        return script, subprocess.run([sys.executable, str(script), "--help"],
                                      capture_output=True, text=True, timeout=120, cwd="/")

    failed = {}
    with ThreadPoolExecutor(2) as pool:   # each one mostly waits for imports: two at a time
        for script, done in pool.map(answer, scripts):
            has_cli = "argparse" in script.read_text()
            if done.returncode != 0 or (has_cli and "usage:" not in done.stdout):
                failed[script.name] = (done.stderr or done.stdout)[-800:]
    assert not failed, failed


def test_no_script_reaches_another_through_sys_path():
    """Only gpu_check.py edits sys.path: on a bare GPU host it makes the checkout itself
    importable (a symlink named tokenloom) and adds the carried wheels."""
    offenders = [p.name for p in BENCH.glob("*.py")
                 if "sys.path.insert" in p.read_text() and p.name != "gpu_check.py"]
    assert offenders == []
