"""lm-eval-harness against a live `tokenloom serve` (its `local-completions` model: echo +
logprobs for loglikelihood, plain completions for generate_until) scores as lm-eval's own
`hf` model does on the same weights (fp32, CPU), on two small tasks shipped beside this
file (tests/e2e/lm_eval_tasks: no hub download).

1. the default model (SmolLM2-135M-Instruct) is served on 127.0.0.1
2. lm-eval runs both tasks through local-completions, batches of 8 prompts a request, once
   with token-id prompts (tokenized_requests=True) and once with text prompts
3. lm-eval runs the same tasks with its `hf` model
4. every choice's loglikelihood agrees within 1e-3 (and so do the accuracies), greedy
   flags agree, the generations are equal, and the model scores above chance.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from servers import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
TASKS = ["tokenloom_mc", "tokenloom_gen"]


@pytest.fixture(scope="module")
def served(default_model_dir):
    server = ServerProcess("--model", str(default_model_dir), "--set", "model.device=cpu",
                           "--set", "model.dtype=float32", "--set", "model.num_threads=2",
                           timeout=300)
    yield server
    assert server.stop() == 0


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(TASKS_DIR)   # the task files name their data files relative to it


def evaluate(model: str, model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                  task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                  log_samples=True, bootstrap_iters=0)
    return {task: (out["results"][task],
                   sorted(out["samples"][task], key=lambda s: s["doc_id"])) for task in TASKS}


def test_lm_eval_local_completions_scores_as_hf_on_the_same_weights(served,
                                                                    default_model_dir):
    reference = evaluate("hf", {"pretrained": str(default_model_dir), "dtype": "float32",
                                "device": "cpu", "batch_size": 8})
    mc_ref, gen_ref = reference["tokenloom_mc"], reference["tokenloom_gen"]
    assert mc_ref[0]["acc,none"] > 0.5, "the default model should be well above chance (0.25)"
    for tokenized in (True, False):
        got = evaluate("local-completions", {
            "base_url": served.url + "/v1/completions", "model": "SmolLM2-135M-Instruct",
            "tokenizer": str(default_model_dir), "tokenizer_backend": "huggingface",
            "tokenized_requests": tokenized, "batch_size": 8, "num_concurrent": 1,
            "max_retries": 1, "max_length": 2048})
        mc, gen = got["tokenloom_mc"], got["tokenloom_gen"]
        for metric in ("acc,none", "acc_norm,none"):
            assert abs(mc[0][metric] - mc_ref[0][metric]) < 1e-3, (tokenized, metric)
        assert len(mc[1]) == len(mc_ref[1]) == 20
        for mine, ref in zip(mc[1], mc_ref[1]):
            assert len(mine["resps"]) == len(ref["resps"]) == 4
            for (ll, greedy), (ll_ref, greedy_ref) in zip(
                    (r[0] for r in mine["resps"]), (r[0] for r in ref["resps"])):
                assert abs(ll - ll_ref) < 1e-3, (tokenized, mine["doc_id"], ll, ll_ref)
                assert greedy == greedy_ref, (tokenized, mine["doc_id"])
        assert [s["resps"] for s in gen[1]] == [s["resps"] for s in gen_ref[1]], tokenized
        assert gen[0]["exact_match,strip"] == gen_ref[0]["exact_match,strip"]
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


@pytest.fixture(scope="module")
def served_int8_kv(default_model_dir):
    server = ServerProcess("--model", str(default_model_dir), "--set", "model.device=cpu",
                           "--set", "model.dtype=float32", "--set", "model.num_threads=2",
                           "--set", "cache.kv_dtype=int8", timeout=300)
    yield server
    assert server.stop() == 0


# A second server and lm-eval run (~30 s): the KV gate and the default model's int8-KV
# parity test cover int8 KV in the default run; this scores it end to end (make test-wide).
@pytest.mark.wide
def test_int8_kv_cache_scores_within_the_baselines_standard_error(served, served_int8_kv,
                                                                  default_model_dir, capsys):
    """The KV quantization gate through a real client: lm-eval's local-completions scores
    the multiple-choice task (loglikelihoods from echo + prompt logprobs, which read the
    prompt's K/V back from the cache) on the int8 KV cache within the model-dtype cache's
    standard error."""
    from lm_eval.tasks import TaskManager

    def score(server):
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"base_url": server.url + "/v1/completions",
                        "model": "SmolLM2-135M-Instruct", "tokenizer": str(default_model_dir),
                        "tokenizer_backend": "huggingface", "tokenized_requests": True,
                        "batch_size": 8, "num_concurrent": 1, "max_retries": 1,
                        "max_length": 2048},
            tasks=["tokenloom_mc"], task_manager=TaskManager(include_path=str(TASKS_DIR)),
            log_samples=True, bootstrap_iters=0)
        samples = sorted(out["samples"]["tokenloom_mc"], key=lambda s: s["doc_id"])
        return out["results"]["tokenloom_mc"]["acc,none"], [
            r[0][0] for s in samples for r in s["resps"]]

    base_acc, base_ll = score(served)
    int8_acc, int8_ll = score(served_int8_kv)
    n = len(base_ll) // 4
    stderr = (base_acc * (1 - base_acc) / (n - 1)) ** 0.5
    drift = sum(abs(a - b) for a, b in zip(base_ll, int8_ll)) / len(base_ll)
    with capsys.disabled():
        print(f"\nlm-eval tokenloom_mc ({n} docs): model-dtype KV acc {base_acc:.3f} "
              f"+- {stderr:.3f}, int8 KV acc {int8_acc:.3f}; mean |loglikelihood change| "
              f"{drift:.4f} nats per choice")
    assert abs(int8_acc - base_acc) <= stderr
    assert 0 < drift < 0.15     # the cache is quantized (not bypassed), and only slightly
    # (measured: 0.025 nats per choice with the rotation, 0.045 without, over
    # continuations of several tokens)
