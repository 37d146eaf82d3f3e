"""The docs build and their links.

1. `mkdocs build --strict` over docs/ succeeds (mkdocs.yml makes a page left out of the nav,
   a link to a missing page or anchor, and a link out of docs/ warnings; --strict fails on
   any warning), and every page is in the nav and in the built site;
2. the same build fails when a link, an anchor or a nav entry is broken (so 1 can fail);
3. every relative link in README.md, benchmarks/README.md and docs/*.md reaches an existing
   file, and its #anchor a heading there (GitHub's slugs, which is where these files are read
   outside the site);
4. every repository path a page names in a code span (`actors/kv/kv_manager.py`) exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")       # PyYAML, a dependency of mkdocs
pytest.importorskip("mkdocs")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINKED = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]
TOP_LEVEL = ("actors", "daemon", "graphs", "kernels", "config", "systemd", "deploy",
             "benchmarks", "tests", "docs")
# Written by the benchmarks (their run records, committed as each run makes them), so a doc
# may name a path before the run that creates it.
GENERATED = ("benchmarks/results", "benchmarks/raw")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        cwd=config.parent, capture_output=True, text=True, timeout=300)


def nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_mkdocs_build_is_strict_and_complete(tmp_path):
    site = tmp_path / "site"
    result = mkdocs_build(ROOT / "mkdocs.yml", site)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md")), "nav != docs/*.md"
    for page in pages:
        assert (site / page.replace(".md", ".html")).is_file(), page


def _copy_tree(tmp_path: Path) -> Path:
    work = tmp_path / "repo"
    shutil.copytree(DOCS, work / "docs")
    shutil.copy(ROOT / "mkdocs.yml", work / "mkdocs.yml")
    return work


@pytest.mark.parametrize("breakage", ["missing page", "missing anchor", "page not in nav"])
def test_mkdocs_build_fails_on_a_broken_docs_tree(tmp_path, breakage):
    work = _copy_tree(tmp_path)
    index = work / "docs" / "index.md"
    if breakage == "missing page":
        index.write_text(index.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    elif breakage == "missing anchor":
        index.write_text(index.read_text() + "\nSee [there](http-api.md#no-such-heading).\n")
    else:
        (work / "docs" / "orphan.md").write_text("# Orphan\n\nIn no nav.\n")
    result = mkdocs_build(work / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0, f"{breakage}: the strict build passed"
    assert "no-such" in result.stderr or "orphan.md" in result.stderr, result.stderr


FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")


def prose_lines(path: Path):
    """(line number, text) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def github_slugs(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings (lowercase, punctuation dropped, spaces
    to hyphens, -1, -2 ... for repeats)."""
    seen: dict[str, int] = {}
    slugs = set()
    for _, line in prose_lines(path):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def test_relative_links_resolve():
    broken = []
    for path in LINKED:
        for n, line in prose_lines(path):
            for _, target in LINK.findall(CODE_SPAN.sub("", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}:{n}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in github_slugs(dest):
                    broken.append(f"{where} (no heading #{anchor} in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _path_exists(span: str) -> bool:
    if (ROOT / span).exists():
        return True
    # `kernels/sampling.py`'s attribute spelled as a module path: `a/b.name` -> a/b.py
    head, _, _ = span.rpartition(".")
    return bool(head) and (ROOT / f"{head}.py").exists()


def test_source_paths_named_in_the_docs_exist():
    pattern = re.compile(r"^(%s)/[\w./-]*$" % "|".join(TOP_LEVEL))
    missing = []
    for path in LINKED:
        for n, line in prose_lines(path):
            for span in CODE_SPAN.findall(line):
                span = span.strip()
                if not pattern.match(span) or span.startswith(GENERATED):
                    continue
                if not _path_exists(span.rstrip("/")):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: `{span}`")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
