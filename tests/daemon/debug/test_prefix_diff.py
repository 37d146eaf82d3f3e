"""`tokenloom debug prefix-diff`: the first divergence of two requests' token sequences."""

from __future__ import annotations

import json

import pytest

from tokenloom.daemon.__main__ import main
from tokenloom.daemon.debug.prefix_diff import PrefixDiff, common_prefix


def test_common_prefix_and_reusable_tokens():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    d = PrefixDiff(len_a=70, len_b=70, common=49, block_size=16)
    assert d.first_divergent_block == 3 and d.reusable_tokens == 48
    # Identical 33-token prompts: the block holding the last token is recomputed.
    same = PrefixDiff(len_a=33, len_b=33, common=33, block_size=16)
    assert same.identical and same.reusable_tokens == 32
    assert PrefixDiff(len_a=32, len_b=32, common=32, block_size=16).reusable_tokens == 16


@pytest.mark.slow
def test_cli_shows_where_chat_bodies_diverge(default_model_dir, tmp_path, capsys):
    """A volatile field early in the prompt (the seeds' example) ends reuse there."""
    system = {"role": "system", "content": "You are a support bot. Policy: refunds within 30 "
              "days; exchanges within 60 days; keep the receipt. Tools: lookup_order."}
    a = {"model": "m", "messages": [system, {"role": "user", "content": "id=123 Where is it?"}]}
    b = {"model": "m", "messages": [system, {"role": "user", "content": "id=124 Where is it?"}]}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    rc = main(["debug", "prefix-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
               "--model", str(default_model_dir)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "first difference at token" in out
    assert "'3 Where is it?" in out and "'4 Where is it?" in out
    assert "can reuse" in out


@pytest.mark.slow
def test_cli_token_id_prompts_identical(default_model_dir, tmp_path, capsys):
    body = {"model": "m", "prompt": list(range(100, 140))}
    (tmp_path / "a.json").write_text(json.dumps(body))
    rc = main(["debug", "prefix-diff", str(tmp_path / "a.json"), str(tmp_path / "a.json"),
               "--model", str(default_model_dir)])
    out = capsys.readouterr().out
    assert rc == 0 and "identical token sequences" in out
    assert "can reuse 32 cached tokens (2 full blocks)" in out
