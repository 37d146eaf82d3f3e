"""Daemon test fixtures: a tiny random Llama (with a chat template and a 2,048-token context)
served on 127.0.0.1 by a server thread shared by a test module."""

from __future__ import annotations

import pytest

from tinymodel import CHAT_TEMPLATE, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-chat")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True,
                                               max_position_embeddings=2048), seed=7,
                     chat_template=CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """A server on 127.0.0.1 (free port) shared by the tests of one module."""
    from servers import ServerThread, tiny_config

    s = ServerThread(tiny_config(tiny_model_dir, tmp_path_factory.mktemp("cache")))
    yield s
    s.close()


@pytest.fixture(scope="session")
def model_name(tiny_model_dir) -> str:
    return tiny_model_dir.name
