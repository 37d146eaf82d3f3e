"""The package layout the design card promises: actors/ holds the shared pieces and one
folder per concern of the request flow; in each concern folder the actor shell is the
`*_actor.py` module and the only one that imports asyncio (the rest are pure cores)."""

from __future__ import annotations

import ast
from pathlib import Path

ACTORS = Path(__file__).resolve().parents[2] / "actors"


def _imports_asyncio(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "asyncio" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "asyncio":
            return True
    return False


def _defines_actor(path: Path) -> bool:
    return any(isinstance(node, ast.ClassDef) and any(
        getattr(b, "id", None) == "Actor" for b in node.bases)
        for node in ast.walk(ast.parse(path.read_text())))


def test_top_level_of_actors_is_small():
    assert len(list(ACTORS.glob("*.py"))) <= 8


def test_only_actor_shells_import_asyncio_in_concern_folders():
    folders = [d for d in ACTORS.iterdir() if (d / "__init__.py").exists()]
    assert {d.name for d in folders} >= {"front", "scheduling", "output", "kv", "execution",
                                         "speculation"}
    for folder in folders:
        for path in folder.glob("*.py"):
            shell = path.stem.endswith("_actor")
            if _imports_asyncio(path):
                assert shell, f"{path.relative_to(ACTORS)} imports asyncio but is not a shell"
            if _defines_actor(path):
                assert shell, f"{path.relative_to(ACTORS)} defines an Actor: name it *_actor.py"
