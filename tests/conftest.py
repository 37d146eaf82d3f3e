"""Shared fixtures. The default model is converted once per machine into the user cache
(or $TOKENLOOM_TEST_CACHE), exactly as `make serve` would."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import tokenloom  # noqa: F401  (first: it takes the checkout off sys.path, see its __init__)

# Shared helpers (tinymodel, ...) are plain modules in tests/; make them importable.
sys.path.insert(0, str(Path(__file__).parent))

# Engines in tests run decode eager: compiling CPU decode programs costs tens of seconds per
# engine on a cold cache. The tests of the compiled path (tests/graphs/test_cpu_compile.py)
# turn it on explicitly. Inherited by the servers tests start as subprocesses.
os.environ.setdefault("TOKENLOOM_GRAPHS__CPU_COMPILE", "false")


def pytest_sessionstart(session) -> None:
    """Build the C++ kernels a fresh machine lacks in parallel before any test imports
    them (one at a time on first use, ~3 minutes of a fresh clone's run on 2 cores)."""
    from tokenloom.kernels.cpu.cpp_build import prebuild
    prebuild()


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    """After a module's tests: collect the reference cycles engines leave (an aiohttp
    application, its state, the engine: their memory is let go when the engine stops, but
    the objects wait for a full collection) and hand the heap's free pages back, so the
    suite's resident size stays that of one module's engines, not the sum of all."""
    yield
    import gc

    from tokenloom.kernels.cpu.allocator import release_freed_memory
    gc.collect()
    release_freed_memory()


def test_cache_dir() -> Path:
    env = os.environ.get("TOKENLOOM_TEST_CACHE")
    if env:
        return Path(env)
    from tokenloom.config.schema import ModelConfig, resolve_cache_dir
    return resolve_cache_dir(ModelConfig())


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from tokenloom.kernels.models.loader import resolve_model_dir
    return resolve_model_dir("default", test_cache_dir())


# CI runs derandomized property tests (the same examples every run, so a red CI is
# reproducible); local runs keep exploring new examples.
from hypothesis import settings as _hsettings  # noqa: E402

_hsettings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    _hsettings.load_profile("ci")
