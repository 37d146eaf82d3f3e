"""The handoff tier between two engines on CPU (the GPU check runs the same with
device "cuda": tests/gpu/test_disagg_cuda.py): see tests/handoff_engines.py."""

from __future__ import annotations

from handoff_engines import run_handoff_between_engines


def test_decode_engine_restores_what_the_prefill_engine_wrote(tmp_path):
    run_handoff_between_engines(tmp_path, "cpu")
