"""The long schemathesis run: fuzz every operation of /openapi.json against a live server.

    python benchmarks/fuzz_api.py --max-examples 500            # a tiny random Llama
    python benchmarks/fuzz_api.py --url http://127.0.0.1:8000    # a server already running

Without --url it starts `tokenloom serve` on a tiny random Llama (n <= 4, max_tokens <= 32,
so fuzzed requests stay cheap) with its admin socket in a temporary directory. The checks
are the suite's (tests/daemon/openai/test_openapi.py): no 5xx, and status codes, content types and
bodies as documented, over positive and negative data, every phase schemathesis has for a
stateless API. Afterwards the server must be idle with no KV block in use (checked through
the admin socket when this script started the server). Prints schemathesis's summary and
exits non-zero on any failure; a run on its own server is recorded (benchmarks/records.py).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import start_tokenloom, tests_module
from records import record_run

ST = str(Path(sys.executable).with_name("st"))
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance," \
         "response_schema_conformance"


def fuzz(url: str, max_examples: int, seed: int) -> tuple[int, str]:
    with tempfile.TemporaryDirectory(prefix="tokenloom-st-") as cwd:   # st's cache dir
        p = subprocess.run([ST, "run", url + "/openapi.json", "--checks", CHECKS,
                            "--max-examples", str(max_examples), "--seed", str(seed),
                            "--no-color"], capture_output=True, text=True, cwd=cwd)
    return p.returncode, p.stdout


def idle_blocks(admin: str, timeout: float = 60.0) -> int:
    from tokenloom.daemon.admin import cli as admin_cli
    from tokenloom.daemon.admin import protocol as P

    deadline = time.monotonic() + timeout
    while True:
        s = admin_cli.send(admin, P.Stats(), 30)
        e = s.engine
        if (e.scheduler.running == 0 and e.scheduler.waiting == 0 and e.kv.used == 0) \
                or time.monotonic() > deadline:
            return e.kv.used
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (default: start one on a tiny model)")
    p.add_argument("--max-examples", type=int, default=500, help="per operation and phase")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.url:
        rc, out = fuzz(args.url, args.max_examples, args.seed)
        print(out[-4000:])
        return rc
    tinymodel = tests_module("tinymodel")

    with tempfile.TemporaryDirectory(prefix="tokenloom-fuzz-") as tmp:
        tmp = Path(tmp)
        tinymodel.build_tiny_model(tmp / "tiny", "LlamaConfig", dict(
            num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=2048),
            seed=7, chat_template=tinymodel.CHAT_TEMPLATE)
        admin = str(tmp / "admin.sock")
        server = start_tokenloom(str(tmp / "tiny"), [
            f'admin.socket_path="{admin}"', f'model.cache_dir="{tmp / "cache"}"',
            'model.device="cpu"', 'model.dtype="float32"', "server.max_n=4",
            "server.max_tokens=32"], timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            t0 = time.monotonic()
            rc, out = fuzz(server.url, args.max_examples, args.seed)
            seconds = time.monotonic() - t0
            used = idle_blocks(admin)
        finally:
            code = server.stop()
    summary = re.search(r"(\d+) generated, (.*)", out)
    print(out[-3000:])
    print(f"test cases: {summary.group(0) if summary else '?'} in {seconds:.0f} s; "
          f"KV blocks in use afterwards: {used}; server exit code {code}")
    failed = bool(rc or used or code)
    table = {"columns": ["test cases", "seconds", "schemathesis exit code",
                         "KV blocks in use afterwards", "server exit code", "result"],
             "rows": [[summary.group(0) if summary else "?", seconds, rc, used, code,
                       "FAILED" if failed else "passed"]]}
    record_run("fuzz_api", {"passed": not failed, "seconds": seconds}, table, args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
