"""The wheel built from the repo installs and serves without the source tree.

1. `pip wheel --no-deps --no-build-isolation` builds the wheel from a copy of the repo (so the
   build leaves no build/ or *.egg-info in the checkout);
2. its file list has every package directory of the tree (each folder with an __init__.py),
   the C++ kernel sources and config/default.toml, and nothing at the top level but
   `tokenloom` (no stray `daemon`, `config` or `kernels` package);
3. a fresh venv gets the test venv's dependencies through a .pth line (the running
   interpreter's site-packages, where the editable tokenloom's own .pth is not processed) and
   the wheel by `pip install --no-deps`; `import tokenloom` there resolves to the new venv's
   site-packages, and the kernel sources are found through importlib.resources;
4. from a directory outside the source tree, the installed `tokenloom serve --workers 2`
   serves a tiny random model: /ready turns 200, one completion returns tokens, and SIGTERM
   ends it with status 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from servers import ServerProcess

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from: the package tree, not the checkout's venv, tests or results.
IGNORED = shutil.ignore_patterns(".git", ".venv", "venv", "build", "*.egg-info", "__pycache__",
                                 "tests", "benchmarks", "gpu-wheels", ".whl", ".pytest_cache",
                                 ".hypothesis", "site")
# Run the installed copy only: nothing of the source tree (PYTHONPATH) or of the test venv's
# activation may leak into the new venv's processes.
CLEAN_ENV = {"PYTHONPATH": None, "VIRTUAL_ENV": None, "PYTHONHOME": None}


def _package_dirs() -> list[str]:
    """Every package of the tree as its path inside the wheel (tokenloom/...): each folder
    with an __init__.py under a top-level folder that is not tests, benchmarks or a venv."""
    out = ["tokenloom"]
    skip = {"tests", "benchmarks", "build", "site", "venv", "gpu-wheels"}
    for top in sorted(REPO.iterdir()):
        if not top.is_dir() or top.name in skip or top.name.startswith("."):
            continue
        for init in sorted(top.rglob("__init__.py")):
            rel = init.parent.relative_to(REPO)
            if "__pycache__" not in rel.parts:
                out.append("/".join(("tokenloom", *rel.parts)))
    return out


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in CLEAN_ENV:
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=IGNORED)
    out = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
                   check=True, timeout=600)
    (built,) = out.glob("tokenloom-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the wheel, with the test venv's dependencies reached by a .pth."""
    root = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                   timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, env=_env()).stdout.strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "test_venv_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--disable-pip-version-check", "-q", str(wheel)],
                   check=True, timeout=300, env=_env())
    return root


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tinymodel import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True),
                     seed=11)
    return path


def test_the_wheel_lists_every_package_the_kernel_sources_and_the_default_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in _package_dirs():
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    for module in REPO.glob("*.py"):             # tokenloom.arith, tokenloom.startup_log...
        assert f"tokenloom/{module.name}" in names
    sources = sorted((REPO / "kernels" / "cpu" / "csrc").glob("*.cpp"))
    assert sources
    for cpp in [*sources, *(REPO / "kernels" / "cpu" / "csrc").glob("*.h")]:
        assert f"tokenloom/kernels/cpu/csrc/{cpp.name}" in names
    assert "tokenloom/config/default.toml" in names
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"tokenloom"}


def test_the_install_imports_from_its_own_site_packages(venv, tmp_path):
    probe = ("import importlib.resources, json, sysconfig, tokenloom\n"
             "from tokenloom.kernels.cpu import cpp_build\n"
             "csrc = importlib.resources.files('tokenloom.kernels.cpu') / 'csrc'\n"
             "print(json.dumps({'file': tokenloom.__file__,\n"
             "  'site': sysconfig.get_paths()['purelib'],\n"
             "  'sources': sorted(p.name for p in csrc.iterdir()\n"
             "                   if p.name.endswith(('.cpp', '.h'))),\n"
             "  'build_dir': str(cpp_build.CSRC)}))\n")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path,
                          capture_output=True, text=True, env=_env(), check=True, timeout=120)
    found = json.loads(done.stdout)
    site = Path(found["site"]).resolve()
    assert Path(found["file"]).resolve().is_relative_to(site), found
    assert not Path(found["file"]).resolve().is_relative_to(REPO), found
    expected = sorted(p.name for p in (REPO / "kernels" / "cpu" / "csrc").iterdir()
                      if p.suffix in (".cpp", ".h"))
    assert found["sources"] == expected
    assert Path(found["build_dir"]).resolve().is_relative_to(site)   # what cpp_build compiles


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow   # ~80 s on 2 busy cores: two worker processes load torch and the model
def test_the_installed_command_serves_with_two_workers(venv, tiny_model, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    server = ServerProcess(
        "--workers", "2", "--model", str(tiny_model), "--set", "model.device=cpu",
        "--set", "model.dtype=float32", "--set", f"model.cache_dir={tmp_path / 'cache'}",
        "--set", "cache.block_size=8", "--set", "cache.num_blocks=256",
        "--set", f"admin.socket_path={tmp_path / 'admin.sock'}",
        command=(str(venv / "bin" / "tokenloom"),), cwd=str(outside), env=CLEAN_ENV, timeout=300)
    try:
        deadline = time.monotonic() + 300
        while _get(server.url + "/ready") != 200:
            assert server.proc.poll() is None, "\n".join(server.lines[-30:])
            assert time.monotonic() < deadline, "never ready:\n" + "\n".join(server.lines[-30:])
            time.sleep(0.2)
        body = {"model": tiny_model.name, "prompt": "w5 w6 w7 w8", "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(server.url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            status, reply = r.status, json.loads(r.read())
        assert status == 200
        assert reply["usage"]["completion_tokens"] == 6
        assert reply["choices"][0]["text"].strip()
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            workers = json.loads(r.read())["workers"]
        up = {w["worker"]: w["pid"] for w in workers if w["up"]}
        assert sorted(up) == [0, 1], workers
        for pid in up.values():     # the workers run the new venv's interpreter too
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert argv[0].decode() == str(venv / "bin" / "python"), argv
    finally:
        code = server.stop()
    assert code == 0, "\n".join(server.lines[-30:])
