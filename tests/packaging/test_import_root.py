"""The repository root is not an import root: its top-level folders never shadow the PyPI
packages of the same names for code run there (`python -c`, `python -`, a REPL, a notebook),
where the working directory is first on sys.path.

1. `import peft` and `import transformers.integrations.hub_kernels` succeed from the root
   (transformers imports Hugging Face's `kernels` package, which the design card's
   top-level `kernels/` folder once shadowed);
2. there, `kernels` is Hugging Face's package from site-packages, not the folder: the folder
   has no `__init__.py`, so a regular package later on sys.path takes precedence over it;
3. `tokenloom.kernels` still imports, as a namespace package over the folder.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_from_root(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("module", ["peft", "transformers.integrations.hub_kernels"])
def test_imports_from_the_repository_root(module):
    result = run_from_root(f"import {module}")
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("kernels") is None,
                    reason="Hugging Face's kernels package is not installed")
def test_kernels_is_the_hub_package_and_tokenloom_kernels_still_imports():
    result = run_from_root("import kernels, tokenloom.kernels.sampling as s; "
                           "print(kernels.__file__); print(s.__file__)")
    assert result.returncode == 0, result.stderr[-2000:]
    hub, ours = result.stdout.split()
    assert "site-packages" in hub and not hub.startswith(str(REPO / "kernels")), hub
    assert ours == str(REPO / "kernels" / "sampling.py"), ours
    assert not (REPO / "kernels" / "__init__.py").exists()
