"""Piecewise graphs (graphs/piecewise.py) on CPU: the cut at attention, padding, dispatch.

On CPU nothing is captured, but `PiecewiseGraphs.run` executes exactly the pieces a graph
would replay, eagerly, over the static buffers, with attention in between. Driving a
ModelRunner through it with mixed prefill+decode steps therefore checks, on a real (tiny)
model: the pieces compose to the plain forward (logits and tokens), chunks that start
mid-prompt, padded tokens write no KV, and the dispatcher's token buckets and counters.
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
from tokenloom.config.schema import ConfigError, GraphsConfig
from tokenloom.graphs import setup as graph_setup
from tokenloom.graphs.buckets import PaddedSizeTable, default_token_sizes
from tokenloom.graphs.buffers import DecodeBuffers
from tokenloom.graphs.capture import CaptureClosedError, CaptureError, DecodeGraphs
from tokenloom.graphs.dispatch import EAGER, GRAPH, PIECEWISE, Dispatcher
from tokenloom.graphs.piecewise import PiecewiseBuffers, PiecewiseGraphs
from tokenloom.kernels.kv_store import KVCache
from tokenloom.kernels.models.loader import load_model, load_spec
from tinymodel import VOCAB, build_tiny_model

BS = 8
NUM_BLOCKS = 80
MAX_BLOCKS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("piecewise-tiny")
    build_tiny_model(path, "LlamaConfig", dict(num_hidden_layers=3, tie_word_embeddings=True),
                     seed=9)
    spec = load_spec(path)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), spec.max_position_embeddings)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, spec, hf, path


def _kv(spec) -> KVCache:
    return KVCache.allocate(spec.num_layers, NUM_BLOCKS, BS, spec.num_kv_heads, spec.head_dim,
                            torch.float32, "cpu")


def _piecewise_runner(model, spec, token_sizes=(8, 16, 32, 48), decode_sizes=(1, 2, 4)):
    kv = _kv(spec)
    graphs = DecodeGraphs(model, kv, DecodeBuffers(max(decode_sizes), MAX_BLOCKS, BS,
                                                   spec.vocab_size, "cpu"))
    pieces = PiecewiseGraphs(model, kv, PiecewiseBuffers(model, max(token_sizes), "cpu"))
    dispatcher = Dispatcher(PaddedSizeTable(decode_sizes),
                            token_table=PaddedSizeTable(token_sizes))
    return ModelRunner(model, kv, torch.device("cpu"), (2,), graphs, dispatcher,
                       piecewise=pieces)


def _drive(runner: ModelRunner, prompts, tables, chunks: list[int], steps: int):
    """Continuous batching by hand: every step decodes each sequence whose prompt is done
    (decodes first) and gives each unfinished prompt its next chunk of `chunks[i]` tokens.
    Returns (tokens per sequence, logits of every step)."""
    done = {i: 0 for i in range(len(prompts))}        # prompt tokens computed
    out_tokens = {f"r{i}": [] for i in range(len(prompts))}
    all_logits = []
    for step in range(steps):
        decodes, prefills = [], []
        for i, p in enumerate(prompts):
            rid = f"r{i}"
            if done[i] == len(p):
                pos = len(p) + len(out_tokens[rid]) - 1
                decodes.append(ScheduledSequence(request_id=rid, token_ids=[out_tokens[rid][-1]],
                                                 start_pos=pos, block_table=tables[i][: pos // BS + 1],
                                                 sample=True))
            else:
                n = min(chunks[i], len(p) - done[i])
                end = done[i] + n
                prefills.append(ScheduledSequence(
                    request_id=rid, token_ids=p[done[i]:end], start_pos=done[i],
                    block_table=tables[i][: cdiv(end, BS)], sample=end == len(p),
                    new=NewSequence(prompt_token_ids=p, output_token_ids=[],
                                    sampling_params=GREEDY) if done[i] == 0 else None))
                done[i] = end
        batch = ExecuteBatch(step=step, sequences=decodes + prefills, num_decodes=len(decodes))
        all_logits.append(runner.forward_logits(batch))
        # forward_logits already wrote this step's KV; rewriting the same values is harmless.
        out = runner.execute(ExecuteBatch(step=step, sequences=decodes + prefills,
                                          num_decodes=len(decodes)))
        for s in out.sampled:
            out_tokens[s.request_id].append(s.token_id)
    return out_tokens, all_logits


def test_pieces_compose_to_the_plain_forward_and_match_transformers(tiny):
    model, spec, hf, _ = tiny
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (21, 9, 40, 3, 17)]
    blocks = list(range(1, NUM_BLOCKS))   # block 0 is in no table: padding must not touch it
    rng.shuffle(blocks)
    tables = [blocks[i * MAX_BLOCKS:(i + 1) * MAX_BLOCKS] for i in range(len(prompts))]
    # Chunk sizes mix prompts that finish in one step, in several (starting mid-prompt and
    # mid-block) and a step of 5 chunks above the largest token bucket (48).
    chunks = [21, 4, 13, 3, 8]
    eager = ModelRunner(model, _kv(spec), torch.device("cpu"), (2,))
    pieces = _piecewise_runner(model, spec, decode_sizes=(1, 2, 4, 8))
    tok_e, log_e = _drive(eager, prompts, tables, chunks, 10)
    tok_p, log_p = _drive(pieces, prompts, tables, chunks, 10)
    for a, b in zip(log_e, log_p):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < 1e-4
    assert tok_e == tok_p
    stats = pieces.graph_stats()
    # Both dispatches of a step (forward_logits and execute) counted.
    assert stats.piecewise_steps > 0 and stats.graph_steps > 0
    assert stats.eager_reasons == {"more tokens than the largest token bucket": 2}
    assert stats.piecewise_static_eager_runs == stats.piecewise_steps
    assert stats.piecewise_padded_tokens > 0 and stats.piecewise_replays == 0
    assert 0 < stats.piecewise_padding_waste_fraction < 1
    kv = pieces.kv
    assert all((k[0] == 0).all() and (v[0] == 0).all() for k, v in zip(kv.key, kv.value))
    # Against the oracle: sequence 2 (a 40-token prompt in 4 chunks, then decodes).
    n = len(tok_p["r2"])
    ids = torch.tensor([prompts[2]])
    ref = hf.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))[0, len(prompts[2]):].tolist()
    assert n >= 5 and tok_p["r2"] == ref


def test_padded_tokens_are_harmless_and_buffers_are_stable(tiny):
    model, spec, _, _ = tiny
    buffers = PiecewiseBuffers(model, 32, "cpu")
    ptrs = [t.data_ptr() for t in (buffers.input_ids, buffers.hidden, buffers.q, buffers.attn_out)]
    buffers.fill(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), torch.tensor([9, 10, 11]), 8)
    assert buffers.input_ids[:8].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert buffers.positions[:8].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert buffers.slot_mapping[:8].tolist() == [9, 10, 11, -1, -1, -1, -1, -1]
    buffers.fill(torch.tensor([1]), torch.tensor([4]), torch.tensor([3]), 2)
    assert buffers.slot_mapping[:3].tolist() == [3, -1, 11]   # rows past the bucket: unread
    assert ptrs == [t.data_ptr() for t in (buffers.input_ids, buffers.hidden, buffers.q,
                                           buffers.attn_out)]
    with pytest.raises(AssertionError, match="cannot pad"):
        buffers.fill(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), 2)


def test_capture_is_closed_outside_start_up(tiny):
    model, spec, _, _ = tiny
    pieces = PiecewiseGraphs(model, _kv(spec), PiecewiseBuffers(model, 8, "cpu"))
    with pytest.raises(CaptureClosedError):
        pieces.capture_one(8)
    with pytest.raises(CaptureError, match="need a CUDA device"):
        pieces.capture((8,), 1 << 30)


def test_dispatch_with_token_buckets():
    d = Dispatcher(PaddedSizeTable((1, 2, 4)), token_table=PaddedSizeTable((8, 16, 32)))
    assert d.decide(3, 3, 3) == d.decide(3, 3, 3)
    assert (d.decide(3, 3, 3).mode, d.decide(3, 3, 3).padded_size) == (GRAPH, 4)
    mixed = d.decide(3, 2, 12)
    assert (mixed.mode, mixed.padded_size, mixed.reason) == (PIECEWISE, 16, "token bucket 16")
    assert d.decide(1, 0, 32).padded_size == 32                        # prefill only
    big_decode = d.decide(6, 6, 6)                                     # above the decode buckets
    assert (big_decode.mode, big_decode.padded_size) == (PIECEWISE, 8)
    assert d.decide(2, 1, 33) == d.decide(2, 1, 33)
    assert d.decide(2, 1, 33).mode == EAGER
    assert d.decide(2, 1, 33).reason == "more tokens than the largest token bucket"
    # Piecewise only (decode graphs failed): decode batches go piecewise too.
    only = Dispatcher(None, "capture failed", token_table=PaddedSizeTable((8,)))
    assert only.decide(2, 2, 2).mode == PIECEWISE
    # Neither: the reasons an operator sees.
    off = Dispatcher(PaddedSizeTable((1,)), piecewise_reason="prefill in batch (graphs.piecewise is off)")
    assert off.decide(2, 1, 9).reason == "prefill in batch (graphs.piecewise is off)"
    for n_tokens in (12, 12, 33):
        d.dispatch(3, 2, n_tokens)
    s = d.stats()
    assert s["piecewise_steps"] == 2 and s["piecewise_real_tokens"] == 24
    assert s["piecewise_padded_tokens"] == 8 and s["piecewise_padding_waste_fraction"] == 8 / 32
    assert s["eager_reasons"] == {"more tokens than the largest token bucket": 1}
    assert s["piecewise_token_sizes"] == [8, 16, 32]


def test_default_token_sizes_bound_the_padding():
    sizes = default_token_sizes(2048)
    assert sizes[:7] == (8, 16, 24, 32, 48, 64, 72) and sizes[-1] == 2048 and len(sizes) == 46
    table = PaddedSizeTable(sizes)
    for n in range(64, 2049):
        assert table.padded(n) - n <= n / 8
    assert default_token_sizes(100)[-1] == 100 and default_token_sizes(5) == (5,)
    with pytest.raises(ValueError):
        default_token_sizes(0)


def test_setup_reasons_and_config(tiny, monkeypatch):
    model, spec, _, _ = tiny
    cpu = Dispatcher(None, "eager on cpu")
    assert graph_setup.build_piecewise_graphs(GraphsConfig(), model, _kv(spec), cpu, None,
                                              max_num_batched_tokens=64,
                                              device=torch.device("cpu")) is None
    assert cpu.token_table is None and cpu.piecewise_reason == "prefill in batch"
    cuda = torch.device("cuda")   # every reason below is found before the device is touched
    for cfg, why in ((GraphsConfig(enforce_eager=True), "graphs.enforce_eager"),
                     (GraphsConfig(piecewise=False), "graphs.piecewise is off"),
                     (GraphsConfig(), "no graph-safe KV store kernel")):
        d = Dispatcher(None)
        with capture_logs() as logs:
            assert graph_setup.build_piecewise_graphs(cfg, model, _kv(spec), d, None,
                                                      max_num_batched_tokens=64,
                                                      device=cuda) is None
        assert why in d.piecewise_reason and d.token_table is None
        assert any(why in e["event"] for e in logs)
    # A capture that fails leaves the dispatcher without token buckets, with the reason.

    class Failing(PiecewiseGraphs):
        def __init__(self, model, kv, buffers, pool=None):
            self.graphs = {}

        def capture(self, sizes, budget, progress=True):
            raise CaptureError("piecewise capture failed: RuntimeError: boom")

    monkeypatch.setattr(graph_setup, "PiecewiseGraphs", Failing)
    monkeypatch.setattr(graph_setup, "PiecewiseBuffers", lambda *a: None)
    monkeypatch.setattr(graph_setup.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(model.layers[0].self_attn, "store_fn", object())
    d = Dispatcher(None)
    with capture_logs() as logs:
        assert graph_setup.build_piecewise_graphs(GraphsConfig(), model, _kv(spec), d, None,
                                                  max_num_batched_tokens=64, device=cuda) is None
    assert "boom" in d.piecewise_reason and d.token_table is None
    assert any(e["log_level"] == "warning" and "boom" in e["event"] for e in logs)
    # Token buckets from config.
    assert graph_setup.resolve_token_sizes(GraphsConfig(), 100) == default_token_sizes(100)
    assert graph_setup.resolve_token_sizes(GraphsConfig(piecewise_max_tokens=64), 2048) == \
        default_token_sizes(64)
    assert graph_setup.resolve_token_sizes(GraphsConfig(piecewise_token_sizes=[64, 16, 999]),
                                           512) == (16, 64)
    with pytest.raises(ConfigError, match="piecewise_token_sizes"):
        graph_setup.resolve_token_sizes(GraphsConfig(piecewise_token_sizes=[999]), 512)
    with pytest.raises(ConfigError, match=r"graphs.piecewise_token_sizes must be integers in 1..65536"):
        GraphsConfig(piecewise_token_sizes=[0])


def test_engine_with_piecewise_steps_matches_transformers(tiny, tmp_path, monkeypatch):
    """The whole engine (chunked prefill under a small token budget, prefix hits, decode
    batches) with every step that has prefill tokens run through the pieces, as on CUDA."""
    from tokenloom.actors.llm import LLM

    _, _, hf, path = tiny

    def cpu_pieces(cfg, model, kv, dispatcher, decode_graphs, *, max_num_batched_tokens,
                   device):
        sizes = graph_setup.resolve_token_sizes(cfg, max_num_batched_tokens)
        dispatcher.token_table = PaddedSizeTable(sizes)
        return PiecewiseGraphs(model, kv, PiecewiseBuffers(model, max(sizes), device))

    monkeypatch.setattr(graph_setup, "build_piecewise_graphs", cpu_pieces)
    llm = LLM(model=str(path), quiet=True, dtype="float32", device="cpu",
              cache_dir=str(tmp_path), block_size=BS, max_num_batched_tokens=32,
              max_num_seqs=8)
    request = llm.close
    rng = random.Random(4)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 30, 11)]
    prompts.append([rng.randrange(3, VOCAB) for _ in range(50)])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        outs = llm.generate(prompts, params)
        stats = llm.graph_stats()
    finally:
        request()
    assert stats.piecewise_steps > 0 and stats.piecewise_static_eager_runs > 0
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p])
        ref = hf.generate(ids, do_sample=False, max_new_tokens=8, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones_like(ids))[0, len(p):]
        assert o.outputs[0].token_ids == ref.tolist()
