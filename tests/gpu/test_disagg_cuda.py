"""CUDA-only check of disaggregated prefill/decode (run by `make gpu-check`; skipped, with
the reason, where no CUDA GPU exists): two engines on the GPU, one writing its computed KV
through the handoff tier and one restoring it from there (device -> host -> shared memory
-> host -> device), give the same greedy tokens; each request's time is printed.
The same check runs on CPU in tests/actors/kv/tiers/test_handoff_engines.py. (Two worker
processes on one GPU are not placed by `--workers`: one worker per GPU.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (none here); run `make gpu-check` on a GPU host"),
]


def test_handoff_between_engines_on_the_gpu(tmp_path):
    pytest.importorskip("msgspec")
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from handoff_engines import run_handoff_between_engines

    fetch = run_handoff_between_engines(tmp_path, "cuda")
    print(f"decode engine on the GPU, restore + 8 tokens: "
          f"{[round(s * 1e3, 2) for s in fetch]} ms per request")
