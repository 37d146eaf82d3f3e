"""Fixtures of the agent-API tests: a tiny random model that thinks (tests/thinking_model.py)
served on 127.0.0.1 by a server thread shared by a test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def thinking_model(tmp_path_factory):
    """(model directory, tokenizer facts: vocab_size and the tags' ids)."""
    from thinking_model import build_thinking_model

    path = tmp_path_factory.mktemp("tiny-thinking")
    return path, build_thinking_model(path)


@pytest.fixture(scope="module")
def thinking_server(thinking_model, tmp_path_factory):
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(thinking_model[0], tmp_path_factory.mktemp("cache")))
    yield s
    s.close()


@pytest.fixture(scope="session")
def model_dir_name(thinking_model) -> str:
    """The thinking model's served name."""
    return thinking_model[0].name
