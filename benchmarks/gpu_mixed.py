"""Mixed prefill+decode steps, eager against piecewise graphs (graphs/piecewise.py).

Used by gpu_check.py on a model it built (random weights, decode graphs captured): each
point is one step of `decodes` single-token rows at `context` plus one prefill chunk of
`chunk` tokens that starts mid-prompt (it attends to cached blocks), run eagerly and through
the piecewise graphs of its token bucket, side by side. Reports step times, the speed-up,
the logits difference between the two paths and the replays counted by the pieces.

Importable with nothing but torch (and triton on CUDA), like gpu_check itself.
"""

from __future__ import annotations

from types import SimpleNamespace

BLOCK_SIZE = 16


def mixed_step(decodes: int, chunk: int, context: int, blocks_per_seq: int, vocab: int):
    """`decodes` rows at position `context`, then one chunk of `chunk` tokens at positions
    [context - chunk, context), in blocks after the decode rows' blocks."""
    from tokenloom.arith import cdiv

    assert chunk <= context, "the chunk must fit the context the RoPE table covers"
    n_blocks = context // BLOCK_SIZE + 1
    seqs = [SimpleNamespace(request_id=f"d{i}", token_ids=[(7 * i + 3) % vocab],
                            start_pos=context, sample=True,
                            block_table=[1 + i * blocks_per_seq + j for j in range(n_blocks)])
            for i in range(decodes)]
    start = context - chunk
    first = 1 + decodes * blocks_per_seq
    seqs.append(SimpleNamespace(request_id="p", token_ids=[(11 * j + 5) % vocab
                                                           for j in range(chunk)],
                                start_pos=start, sample=True,
                                block_table=[first + j for j in range(cdiv(context, BLOCK_SIZE))]))
    return SimpleNamespace(sequences=seqs, num_decodes=decodes)


def bench_mixed(m, device: str, timer, *, decodes: int = 8, chunks=(16, 128, 512),
                context: int = 512, steps: int = 20, warmup: int = 3,
                memory_budget_bytes: int = 4 << 30) -> dict:
    """`m`: gpu_check.build()'s model, KV pool and decode graphs. `timer(fn, steps, warmup,
    sync)` -> median seconds of one step. On CPU the pieces run eagerly (nothing captured)."""
    import torch

    from tokenloom.actors.execution.batch_inputs import build_batch_inputs
    from tokenloom.graphs.buckets import PaddedSizeTable, default_token_sizes
    from tokenloom.graphs.piecewise import PiecewiseBuffers, PiecewiseGraphs

    dev = torch.device(device)
    batches = [mixed_step(decodes, c, context, m.bps, m.spec.vocab_size) for c in chunks]
    tokens = [decodes + c for c in chunks]
    ladder = PaddedSizeTable(default_token_sizes(max(tokens)))
    buckets = tuple(sorted({ladder.padded(t) for t in tokens}))
    pieces = PiecewiseGraphs(m.model, m.kv, PiecewiseBuffers(m.model, max(buckets), dev),
                             pool=getattr(m.graphs, "pool", None))
    out = {"buckets": list(buckets), "captured": False, "rows": []}
    if dev.type == "cuda":
        pieces.capture(buckets, memory_budget_bytes, progress=False)
        out.update(captured=True, capture_seconds=pieces.capture_seconds,
                   capture_bytes=pieces.capture_bytes)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for batch, t in zip(batches, tokens):
        inputs = build_batch_inputs(batch, BLOCK_SIZE, dev, with_decode_mask=False)
        padded = ladder.padded(t)

        def eager():
            return m.model(inputs.input_ids, inputs.positions, m.kv, inputs.meta,
                           inputs.logits_indices)

        def piecewise():
            return pieces.run(inputs.input_ids, inputs.positions, inputs.meta,
                              inputs.logits_indices, padded)

        with torch.inference_mode():
            want, got = eager().float(), piecewise().float()
            rel = (want - got).abs().max().item() / max(1e-6, want.abs().max().item())
            replays_before = pieces.num_replays
            t_eager = timer(eager, steps, warmup, sync)
            t_pieces = timer(piecewise, steps, warmup, sync)
        out["rows"].append({"decodes": decodes, "chunk": t - decodes, "tokens": t,
                            "bucket": padded, "eager_ms": 1e3 * t_eager,
                            "piecewise_ms": 1e3 * t_pieces, "speedup": t_eager / t_pieces,
                            "piecewise_vs_eager_max_rel_diff": rel,
                            "piecewise_replays": pieces.num_replays - replays_before})
    del pieces
    return out


def print_mixed(shape: str, d: dict) -> None:
    head = (f"\n{shape} mixed steps (decodes + one mid-prompt chunk), eager vs piecewise graphs"
            + (f": capture {d['capture_seconds']:.1f}s, {d['capture_bytes'] / 2**20:.0f} MiB"
               if d.get("captured") else " (not captured: pieces run eagerly)"))
    print(head)
    print(f"{'decodes':>8} {'chunk':>6} {'bucket':>7} {'eager ms':>9} {'pieces ms':>10} "
          f"{'speedup':>8} {'rel diff':>9} {'replays':>8}")
    for r in d["rows"]:
        print(f"{r['decodes']:>8} {r['chunk']:>6} {r['bucket']:>7} {r['eager_ms']:>9.3f} "
              f"{r['piecewise_ms']:>10.3f} {r['speedup']:>8.2f} "
              f"{r['piecewise_vs_eager_max_rel_diff']:>9.1e} {r['piecewise_replays']:>8}")
