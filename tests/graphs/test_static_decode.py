"""The graph path's inputs on CPU: static buffers, padding, skipped KV slots, dispatch.

On CPU nothing is captured, but `DecodeGraphs.run` executes exactly what a graph would
replay (the forward over the first `padded` rows of the static buffers) eagerly. Driving a
ModelRunner through it therefore checks, with a real (tiny) model:
1. buffer filling: tokens, positions, slots, context lengths and block tables per row;
2. padded rows: slot -1 writes no KV, context length 1 stays finite, real rows unaffected;
3. logits agree with the eager path, and greedy continuations equal transformers';
4. capture is closed outside start-up, and a failed capture falls back to eager with a reason.
"""

from __future__ import annotations

import random

import pytest
import torch
from structlog.testing import capture_logs

from tokenloom.actors.messages import ExecuteBatch, NewSequence, ScheduledSequence
from tokenloom.actors.execution.model_runner import ModelRunner
from tokenloom.actors.sampling_params import SamplingParams
from tokenloom.arith import cdiv
from tokenloom.config.schema import GraphsConfig
from tokenloom.graphs import setup as graph_setup
from tokenloom.graphs.buckets import PaddedSizeTable
from tokenloom.graphs.buffers import PAD_CONTEXT, PAD_SLOT, DecodeBuffers
from tokenloom.graphs.capture import CaptureClosedError, CaptureError, DecodeGraphs
from tokenloom.graphs.dispatch import Dispatcher
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.models.loader import load_model, load_spec
from tinymodel import VOCAB, build_tiny_model

BS = 8
NUM_BLOCKS = 64
MAX_BLOCKS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("graph-tiny")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=2, tie_word_embeddings=True), seed=5)
    spec = load_spec(path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), spec.max_position_embeddings)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, spec, hf


def _kv(spec) -> KVCache:
    return KVCache.allocate(spec.num_layers, NUM_BLOCKS, BS, spec.num_kv_heads, spec.head_dim,
                            torch.float32, "cpu")


def _runners(model, spec, sizes=(1, 2, 4, 8)):
    eager = ModelRunner(model, _kv(spec), torch.device("cpu"), (2,))
    kv = _kv(spec)
    buffers = DecodeBuffers(max(sizes), MAX_BLOCKS, BS, spec.vocab_size, "cpu")
    graphs = DecodeGraphs(model, kv, buffers)
    static = ModelRunner(model, kv, torch.device("cpu"), (2,), graphs,
                         Dispatcher(PaddedSizeTable(sizes)))
    return eager, static


def test_fill_writes_rows_and_pads_safely():
    buf = DecodeBuffers(8, 4, BS, VOCAB, "cpu")
    seqs = [ScheduledSequence(request_id="a", token_ids=[7], start_pos=9, block_table=[5, 3],
                              sample=True),
            ScheduledSequence(request_id="b", token_ids=[11], start_pos=0, block_table=[6],
                              sample=True)]
    buf.fill(seqs, 4)
    assert buf.input_ids[:4].tolist() == [7, 11, 0, 0]
    assert buf.positions[:4].tolist() == [9, 0, 0, 0]
    assert buf.slot_mapping[:4].tolist() == [3 * BS + 1, 6 * BS, PAD_SLOT, PAD_SLOT]
    assert buf.context_lens[:4].tolist() == [10, 1, PAD_CONTEXT, PAD_CONTEXT]
    assert buf.block_tables[0, :2].tolist() == [5, 3] and buf.block_tables[1, 0].item() == 6
    meta = buf.meta(4)
    assert meta.has_skip_slots and meta.num_decodes == 4 and not meta.prefills
    assert meta.decode_max_context == 4 * BS
    # Addresses are stable across steps (what a captured graph relies on).
    ptr = buf.input_ids.data_ptr()
    buf.fill(seqs[:1], 1)
    assert buf.input_ids.data_ptr() == ptr and meta.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr()
    with pytest.raises(AssertionError, match="single decode"):
        buf.fill([ScheduledSequence(request_id="c", token_ids=[1, 2], start_pos=0,
                                    block_table=[0], sample=True)], 1)
    with pytest.raises(AssertionError, match="exceed the graph table width"):
        buf.fill([ScheduledSequence(request_id="d", token_ids=[1], start_pos=0,
                                    block_table=[0] * 5, sample=True)], 1)


def _drive(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]], steps: int,
           decode_sets: list[list[int]]):
    """Prefill every prompt in one (eager) batch, then decode the sequences listed for each
    step; returns (tokens per sequence, logits of every decode step)."""
    seqs = [ScheduledSequence(request_id=f"r{i}", token_ids=p, start_pos=0,
                              block_table=tables[i][: cdiv(len(p), BS)], sample=True,
                              new=NewSequence(prompt_token_ids=p, output_token_ids=[],
                                              sampling_params=GREEDY))
            for i, p in enumerate(prompts)]
    out = runner.execute(ExecuteBatch(step=0, sequences=seqs, num_decodes=0))
    tokens = {s.request_id: [s.token_id] for s in out.sampled}
    lens = {f"r{i}": len(p) for i, p in enumerate(prompts)}
    all_logits = []
    for step in range(steps):
        batch = []
        for i in decode_sets[step % len(decode_sets)]:
            rid = f"r{i}"
            pos = lens[rid]
            batch.append(ScheduledSequence(request_id=rid, token_ids=[tokens[rid][-1]],
                                           start_pos=pos, block_table=tables[i][: pos // BS + 1],
                                           sample=True))
            lens[rid] += 1
        eb = ExecuteBatch(step=step + 1, sequences=batch, num_decodes=len(batch))
        all_logits.append(runner.forward_logits(eb))
        # forward_logits already wrote this step's KV; rewriting the same values is harmless.
        out = runner.execute(eb)
        for s in out.sampled:
            tokens[s.request_id].append(s.token_id)
    return tokens, all_logits


def test_static_path_matches_eager_and_transformers(tiny):
    model, spec, hf = tiny
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (13, 8, 30, 1, 22)]
    # Disjoint, shuffled block tables per sequence.
    blocks = list(range(1, NUM_BLOCKS))
    rng.shuffle(blocks)
    tables = [blocks[i * MAX_BLOCKS:(i + 1) * MAX_BLOCKS] for i in range(len(prompts))]
    # Batch sizes 5 (-> 8), 3 (-> 4), 2, 1: every step but two is padded.
    decode_sets = [[0, 1, 2, 3, 4], [0, 2, 4], [1, 3], [2]]
    eager, static = _runners(model, spec)
    tok_e, log_e = _drive(eager, prompts, tables, 12, decode_sets)
    tok_s, log_s = _drive(static, prompts, tables, 12, decode_sets)
    for a, b in zip(log_e, log_s):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-4
    assert tok_e == tok_s
    stats = static.graph_stats()
    # Every decode step replayed (forward_logits and execute both dispatch); prefill was eager.
    assert stats.graph_steps == 2 * 12 and stats.eager_steps == 1
    assert stats.graph_padded_rows > 0
    # Padded rows wrote nothing: block 0 is in no table and must still be all zeros.
    assert all((k[0] == 0).all() and (v[0] == 0).all() for k, v in zip(static.kv.key, static.kv.value))
    # Against the oracle: sequence 2 (prefill + 9 decodes, mostly in padded batches).
    n = len(tok_s["r2"])
    ids = torch.tensor([prompts[2]])
    ref = hf.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))[0, len(prompts[2]):].tolist()
    assert n == 10 and tok_s["r2"] == ref


def test_unsampled_rows_are_dropped_from_graph_logits(tiny):
    model, spec, _ = tiny
    _, static = _runners(model, spec)
    prompt = list(range(3, 12))
    static.execute(ExecuteBatch(step=0, num_decodes=0, sequences=[ScheduledSequence(
        request_id="x", token_ids=prompt, start_pos=0, block_table=[4, 5], sample=True,
        new=NewSequence(prompt_token_ids=prompt, output_token_ids=[], sampling_params=GREEDY))]))
    seqs = [ScheduledSequence(request_id="x", token_ids=[5], start_pos=9, block_table=[4, 5],
                              sample=False)]
    logits = static.forward_logits(ExecuteBatch(step=1, sequences=seqs, num_decodes=1))
    assert logits.shape == (0, spec.vocab_size)


def test_capture_is_closed_outside_start_up(tiny):
    model, spec, _ = tiny
    graphs = DecodeGraphs(model, _kv(spec), DecodeBuffers(2, 2, BS, spec.vocab_size, "cpu"))
    with pytest.raises(CaptureClosedError):
        graphs.capture_one(1)
    with pytest.raises(CaptureError, match="CUDA device"):
        graphs.capture((1, 2), 1 << 30)


def test_setup_on_cpu_is_eager_with_reason(tiny):
    model, spec, _ = tiny
    d, graphs = graph_setup.build_decode_graphs(GraphsConfig(cpu_compile=False), model, _kv(spec),
                                                max_num_seqs=8, max_model_len=64,
                                                device=torch.device("cpu"))
    assert graphs is None and d.table is None
    assert d.decide(1, 1, 1).reason == "graphs.cpu_compile is off"


def test_failed_capture_falls_back_to_eager_with_a_logged_reason(tiny, monkeypatch):
    model, spec, _ = tiny

    class FailingGraphs:
        def __init__(self, *a):
            pass

        def capture(self, sizes, budget):
            raise CaptureError("capture failed: RuntimeError: out of memory")

    monkeypatch.setattr(graph_setup, "DecodeBuffers", lambda *a: None)
    monkeypatch.setattr(graph_setup, "DecodeGraphs", FailingGraphs)
    monkeypatch.setattr(graph_setup.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(model.layers[0].self_attn, "store_fn", object())
    with capture_logs() as events:
        d, graphs = graph_setup.build_decode_graphs(GraphsConfig(), model, _kv(spec),
                                                    max_num_seqs=8, max_model_len=64,
                                                    device=torch.device("cuda"))
    assert graphs is None and d.table is None
    assert "out of memory" in d.disabled_reason
    [event] = events
    assert event["logger_name"] == "tokenloom.startup" and event["log_level"] == "warning"
    assert "CUDA graphs disabled" in event["event"] and "eager" in event["event"]
    assert "out of memory" in event["reason"]


def test_enforce_eager_and_missing_store_kernel(tiny):
    model, spec, _ = tiny
    with capture_logs() as events:
        d, g = graph_setup.build_decode_graphs(GraphsConfig(enforce_eager=True), model,
                                               _kv(spec), max_num_seqs=8, max_model_len=64,
                                               device=torch.device("cuda"))
        assert g is None and d.disabled_reason == "graphs.enforce_eager"
        d, g = graph_setup.build_decode_graphs(GraphsConfig(), model, _kv(spec), max_num_seqs=8,
                                               max_model_len=64, device=torch.device("cuda"))
        assert g is None and "KV store" in d.disabled_reason
    assert [e["logger_name"] for e in events] == ["tokenloom.startup"] * 2
    assert events[0]["event"] == "CUDA graphs off (graphs.enforce_eager); decode runs eager"
    assert "KV store" in events[1]["event"] and "KV store" in events[1]["reason"]


def test_histogram_file_drives_capture_sizes(tmp_path):
    import json

    p = tmp_path / "hist.json"
    p.write_text(json.dumps({"3": 50, "9": 40, "1": 5}))
    cfg = GraphsConfig(histogram_path=str(p), max_graphs=3)
    assert graph_setup.resolve_capture_sizes(cfg, 16) == (3, 9, 16)
    p.write_text("[1, 2]")
    from tokenloom.config.schema import ConfigError
    with pytest.raises(ConfigError, match="histogram_path"):
        graph_setup.resolve_capture_sizes(cfg, 16)


def test_reference_attention_with_long_context_is_not_captured(tiny, monkeypatch):
    model, spec, _ = tiny
    monkeypatch.setattr(model.layers[0].self_attn, "store_fn", object())
    with capture_logs() as events:
        d, g = graph_setup.build_decode_graphs(GraphsConfig(), model, _kv(spec), max_num_seqs=8,
                                               max_model_len=8192, device=torch.device("cuda"))
    assert g is None and "reference attention" in d.disabled_reason
    [event] = events
    assert event["logger_name"] == "tokenloom.startup" and "reference attention" in event["event"]


def test_graph_options_reach_the_config():
    from tokenloom.actors.llm import options_to_overrides
    from tokenloom.config.load import load_config

    overrides = options_to_overrides({"enforce_eager": True, "capture_sizes": [1, 4]})
    assert overrides == {"graphs.enforce_eager": True, "graphs.capture_sizes": [1, 4]}
    cfg = load_config(overrides=overrides, env=None)
    assert cfg.graphs.enforce_eager and cfg.graphs.capture_sizes == [1, 4]
