"""ruff over the repository, with the configuration in pyproject.toml ([tool.ruff]).

1. `ruff check` over the whole tree reports nothing (pycodestyle, pyflakes, import sorting,
   lines up to 100 characters), so the suite fails on a lint error as `make test` does;
2. the same configuration does fail on a file with an error, an unsorted import and a line
   of 101 characters, and passes one of 100 (so 1 can fail, and the line length is ours).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ruff") is None,
    reason="ruff is not installed: it comes with the test extra (pip install -e '.[test]')")


def ruff_check(*args: str) -> subprocess.CompletedProcess:
    # --no-cache: nothing is written into the tree being checked.
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_repository_is_clean():
    done = ruff_check(".")
    assert done.returncode == 0, f"ruff check . found errors:\n{done.stdout}{done.stderr}"


def test_configuration_catches_errors(tmp_path):
    fine = tmp_path / "fine.py"
    fine.write_text(f"X = {'1' * (100 - len('X = '))}\n")
    done = ruff_check("--config", str(PYPROJECT), str(fine))
    assert done.returncode == 0, done.stdout + done.stderr

    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\n"
                   f"X = {'1' * (101 - len('X = '))}\n"
                   "print(undefined_name)\n")
    done = ruff_check("--config", str(PYPROJECT), "--output-format", "concise", str(bad))
    assert done.returncode == 1, done.stdout + done.stderr
    for code in ("I001", "F401", "E501", "F821"):
        assert code in done.stdout, f"{code} not reported:\n{done.stdout}"
