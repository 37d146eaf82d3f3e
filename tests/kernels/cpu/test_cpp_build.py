"""kernels/cpu/cpp_build.py: a module's build is named by the CPU's features and the
content of its source and headers, and compiled from a copy staged under that name, so two
installs of the same code (the checkout and an installed wheel) share one build, and an
edit of a source or a header gets a new one."""

from __future__ import annotations

import shutil

from tokenloom.kernels.cpu import cpp_build

SOURCE = "layer_ops_cpu.cpp"


def test_two_copies_of_the_same_sources_share_one_staged_build(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    first = cpp_build.build_name("m", SOURCE)
    staged = cpp_build.staged_sources(first, SOURCE)
    copy = tmp_path / "site-packages" / "csrc"
    shutil.copytree(cpp_build.CSRC, copy)
    monkeypatch.setattr(cpp_build, "CSRC", copy)
    assert cpp_build.build_name("m", SOURCE) == first
    assert cpp_build.staged_sources(first, SOURCE) == staged    # the same path: no rebuild
    assert staged.read_bytes() == (copy / SOURCE).read_bytes()
    assert sorted(p.name for p in staged.parent.glob("*.h")) == sorted(
        p.name for p in copy.glob("*.h"))


def test_an_edited_source_or_header_gets_another_build(tmp_path, monkeypatch):
    copy = tmp_path / "csrc"
    shutil.copytree(cpp_build.CSRC, copy)
    monkeypatch.setattr(cpp_build, "CSRC", copy)
    names = {cpp_build.build_name("m", SOURCE)}
    (copy / SOURCE).write_text((copy / SOURCE).read_text() + "\n// edited\n")
    names.add(cpp_build.build_name("m", SOURCE))
    header = next(copy.glob("*.h"))
    header.write_text(header.read_text() + "\n// edited\n")
    names.add(cpp_build.build_name("m", SOURCE))
    assert len(names) == 3


def test_the_build_runs_the_pip_installed_ninja():
    import subprocess
    from importlib.metadata import version

    folder = cpp_build.ninja_dir()
    assert folder is not None, "make install puts the ninja package in the venv"
    out = subprocess.run([str(folder / "ninja"), "--version"], capture_output=True, text=True,
                         check=True, timeout=30)
    assert out.stdout.strip().startswith(version("ninja").split(".post")[0][:4])
