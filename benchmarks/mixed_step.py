"""Mixed prefill+decode steps: do they cost what their parts cost?

    .venv/bin/python benchmarks/mixed_step.py                  # SmolLM2-135M shape, fp32, CPU
    .venv/bin/python benchmarks/mixed_step.py --quick          # a smaller grid
    .venv/bin/python benchmarks/mixed_step.py --baseline HEAD  # also time a git revision

One step's forward (build_batch_inputs + the model, as the runner's eager path runs it;
no actors, no sampling) over a random-weight model of the default model's shape and a paged
KV cache whose blocks hold random values, for:
  decode    D single-token decodes at context C
  prefill   a P-token chunk starting at position S (S = 0: a fresh prompt; S > 0: a
            continuation chunk attending to S cached tokens through its block table)
  mixed     both in one step
Reported: median times and mixed / (decode + prefill). Mixing should cost less than the
parts run as two steps (the weights stream once); a ratio near or above 1 means it loses time.

`--baseline REV` times the same grid with the package as it is at git revision REV
(exported to a temporary directory, its C++ kernel built there), in a second worker
process: every variant of every implementation runs once per repetition, in a shuffled
order, so drift and background load hit them alike; reported as new / baseline.

Then the step-cost model (actors/scheduling/cost_model.py; the baseline's too) is fitted on the new
implementation's measurements and its prediction error shown per kind of step: the SLO
chunker sizes chunks with it, so it must see where the time goes. Last, the chunker's
view: for each decode batch, prompt depth and `--chunker-factors` f, the prefill chunk it
grants under the automatic target (f x the predicted decode-only step), and what that
mixed step really costs against the target and against the real decode-only step.
The first table is the run's record (benchmarks/records.py); every figure goes to
benchmarks/raw/mixed_step.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import itertools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from records import record_run, write_raw

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent


def cdiv(a: int, b: int) -> int:
    """tokenloom.arith.cdiv, copied: the worker imports older revisions of the package (--rev),
    which do not all have it."""
    return -(a // -b)


@dataclasses.dataclass
class Seq:
    """The fields of messages.ScheduledSequence that build_batch_inputs reads."""
    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool


@dataclasses.dataclass
class Batch:
    """The fields of messages.ExecuteBatch that build_batch_inputs reads."""
    step: int
    sequences: list[Seq]
    num_decodes: int


class Bench:
    """A model, a KV cache whose blocks hold random values, and batch builders."""

    def __init__(self, shape: str, block_size: int, max_context: int, max_seqs: int,
                 backend: str, threads: int):
        from tokenloom.kernels.kv_store import KVCache
        from tokenloom.kernels.models.random_model import SHAPES, random_model

        if threads:
            torch.set_num_threads(threads)
        spec = SHAPES[shape]
        self.block_size = block_size
        self.vocab = (min(200, spec.vocab_size // 2), min(40000, spec.vocab_size))  # token ids
        self.model = random_model(spec, torch.float32, "cpu", max_context + 1)
        self.backend = "torch"
        if backend in ("auto", "cpu_kernel"):
            from tokenloom.kernels.cpu.attention import load_cpu_decode_kernel, paged_decode_cpu
            if load_cpu_decode_kernel() is not None:
                self.model.set_decode_kernel(paged_decode_cpu)
                self.backend = "cpu_kernel"
            elif backend == "cpu_kernel":
                sys.exit("the CPU decode kernel is unavailable")
        self.blocks_per_seq = cdiv(max_context, block_size)
        num_blocks = (max_seqs + 1) * self.blocks_per_seq + 1
        self.kv = KVCache.allocate(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                                   spec.head_dim, torch.float32, "cpu")
        self.kv.pool.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
        self.rng = random.Random(0)
        self.batches: dict[tuple, Batch] = {}

    def table(self, seq: int, context: int) -> list[int]:
        """Sequence `seq` owns a disjoint run of blocks, shuffled (as a real pool's are)."""
        first = 1 + seq * self.blocks_per_seq
        blocks = list(range(first, first + cdiv(context, self.block_size)))
        random.Random(seq).shuffle(blocks)
        return blocks

    def batch(self, decodes: int, context: int, prefill: int, start: int) -> Batch:
        seqs = [Seq(request_id=f"d{i}", token_ids=[self.rng.randrange(*self.vocab)],
                    start_pos=context - 1, block_table=self.table(i, context), sample=True)
                for i in range(decodes)]
        if prefill:
            ids = [self.rng.randrange(*self.vocab) for _ in range(prefill)]
            seqs.append(Seq(request_id="p", token_ids=ids, start_pos=start,
                            block_table=self.table(decodes, start + prefill), sample=True))
        return Batch(step=0, sequences=seqs, num_decodes=decodes)

    def step(self, variant: tuple) -> float:
        """Seconds for one step: inputs + forward (the runner's eager path, no sampling)."""
        from tokenloom.actors.execution.batch_inputs import build_batch_inputs

        batch = self.batches.get(variant)
        if batch is None:
            batch = self.batches[variant] = self.batch(*variant[1:])
        t0 = time.perf_counter()
        inputs = build_batch_inputs(batch, self.block_size, torch.device("cpu"),
                                    with_decode_mask=self.backend == "torch")
        self.model(inputs.input_ids, inputs.positions, self.kv, inputs.meta,
                   inputs.logits_indices)
        return time.perf_counter() - t0


def worker(config: str) -> None:
    """Serve steps over stdin/stdout: one JSON variant in, its seconds out."""
    cfg = json.loads(config)
    bench = Bench(**cfg)
    print(json.dumps({"backend": bench.backend, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(bench.step(tuple(json.loads(line)))), flush=True)


class Worker:
    """A worker process importing tokenloom from `pythonpath` (None: this checkout)."""

    def __init__(self, config: dict, pythonpath: str | None = None,
                 extensions_dir: str | None = None):
        env = dict(os.environ)
        if pythonpath:  # ahead of the editable install's finder on sys.meta_path
            env["PYTHONPATH"] = pythonpath
        if extensions_dir:  # its own C++ build, not the checkout's
            env["TORCH_EXTENSIONS_DIR"] = extensions_dir
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(config)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        self.info = self._reply()

    def _reply(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited ({self.proc.wait()}); see its stderr")
        return json.loads(line)

    def step(self, variant: tuple) -> float:
        self.proc.stdin.write(json.dumps(list(variant)) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def export_revision(rev: str, into: Path) -> str:
    """The package at `rev`, importable as `tokenloom` from the returned sys.path entry."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    path = into / "path"
    path.mkdir()
    (path / "tokenloom").symlink_to(src)
    return str(path)


def load_cost_model(path: Path | None):
    """actors/scheduling/cost_model.py (pure numpy) of this checkout, or of an exported revision."""
    if path is None:
        from tokenloom.actors.scheduling import cost_model
        return cost_model
    spec = importlib.util.spec_from_file_location("baseline_cost_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def step_work(cm, variant: tuple):
    """(tokens, attention work, prefill tokens) of a variant, as the scheduler sums them."""
    _, d, c, p, s = variant
    work = 0.0
    for _ in range(d):
        work += cm.attention_work(1, c - 1)
    if p:
        work += cm.attention_work(p, s)
    return d + p, work, p


def fit_cost_model(cm, medians: dict):
    """The scheduler's StepCostModel fitted on measured steps {variant: ms}: both of its
    memories (decode-only, with prefill) hold every sample."""
    model = cm.StepCostModel(window=2 * len(medians) + 2, min_samples=1, refit_every=1)
    for variant, ms in medians.items():
        tokens, work, prefill = step_work(cm, variant)
        model.observe(tokens, work, ms / 1000, prefill_tokens=prefill)
    return model


def fit_errors(cm, model, medians: dict) -> dict:
    errors: dict[str, list[float]] = {}
    for variant, ms in medians.items():
        tokens, work, _ = step_work(cm, variant)
        errors.setdefault(variant[0], []).append(model.predict(tokens, work) / (ms / 1000) - 1)
    return {"coef": [float(x) for x in model.coef],
            "rel_error": {k: {"median_abs": statistics.median(map(abs, v)),
                              "max_abs": max(map(abs, v)), "mean": statistics.mean(v)}
                          for k, v in errors.items()}}


def chunker_budget(cm, model, decodes: int, context: int, start: int, factor: float,
                   hi: int) -> tuple[float, int]:
    """What the SLO chunker does with an automatic target: (target seconds, prefill tokens)."""
    d_attn = 0.0
    for _ in range(decodes):
        d_attn += cm.attention_work(1, context - 1)
    target = factor * model.predict(decodes, d_attn)
    return target, model.max_prefill_tokens(target, decodes, d_attn, start, 1, hi)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--decodes", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--starts", type=int, nargs="+", default=[0, 1024])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--backend", choices=["auto", "torch", "cpu_kernel"], default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    ap.add_argument("--baseline", metavar="REV", help="a git revision timed alongside")
    ap.add_argument("--quick", action="store_true", help="D=16, C=1024, P in {64, 512}, 3 reps")
    ap.add_argument("--chunker-factors", type=float, nargs="*", default=[1.5, 2.0],
                    help="check the SLO chunker's budgets at these target factors")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.quick:
        args.decodes, args.contexts, args.chunks, args.reps = [16], [1024], [64, 512], 3

    max_ctx = max(max(args.contexts), max(args.starts) + max(args.chunks))
    config = dict(shape=args.shape, block_size=args.block_size, max_context=max_ctx,
                  max_seqs=max(args.decodes), backend=args.backend, threads=args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="mixed_step_")
    workers = {"new": Worker(config)}
    if args.baseline:
        path = export_revision(args.baseline, Path(tmp.name))
        workers["base"] = Worker(config, path, str(Path(tmp.name) / "torch_extensions"))

    # Unique variants: decode (D, C), prefill (P, S), mixed (D, C, P, S).
    variants = [("decode", d, c, 0, 0) for d, c in itertools.product(args.decodes, args.contexts)]
    variants += [("prefill", 0, 0, p, s) for p, s in itertools.product(args.chunks, args.starts)]
    variants += [("mixed", d, c, p, s) for d, c, p, s in itertools.product(
        args.decodes, args.contexts, args.chunks, args.starts)]
    runs = [(v, name) for v in variants for name in workers]
    for v, name in runs:                     # warm-up: first touch, allocator, kernel build
        workers[name].step(v)
    times: dict[tuple, list[float]] = {r: [] for r in runs}
    order = list(runs)
    shuffler = random.Random(1)
    t_start = time.perf_counter()
    for _ in range(args.reps):
        shuffler.shuffle(order)
        for v, name in order:
            times[(v, name)].append(workers[name].step(v))
    elapsed = time.perf_counter() - t_start
    med = {r: statistics.median(ts) * 1000 for r, ts in times.items()}

    rows = []
    for d, c, p, s in itertools.product(args.decodes, args.contexts, args.chunks, args.starts):
        row = {"decodes": d, "context": c, "chunk": p, "start": s}
        for name in workers:
            dec = med[(("decode", d, c, 0, 0), name)]
            pre = med[(("prefill", 0, 0, p, s), name)]
            mix = med[(("mixed", d, c, p, s), name)]
            row[name] = {"decode_ms": dec, "prefill_ms": pre, "mixed_ms": mix,
                         "mixed_over_sum": mix / (dec + pre)}
        if "base" in workers:
            for part in ("decode", "prefill", "mixed"):
                row[f"{part}_new_over_base"] = (row["new"][f"{part}_ms"]
                                                / row["base"][f"{part}_ms"])
        rows.append(row)

    info = workers["new"].info
    print(f"\n{args.shape} fp32 CPU, {info['threads']} threads, decode backend "
          f"{info['backend']}, block {args.block_size}, {args.reps} reps ({elapsed:.0f} s); "
          f"median ms" + (f"; baseline {args.baseline} (b.)" if args.baseline else ""))
    head = f"{'D':>3}{'C':>6}{'P':>5}{'S':>6}{'decode':>8}{'prefill':>8}{'mixed':>8}{'mix/sum':>8}"
    if "base" in workers:
        head += (f"{'b.dec':>8}{'b.pre':>8}{'b.mixed':>8}{'b.m/sum':>8}"
                 f"{'dec n/b':>8}{'pre n/b':>8}{'mix n/b':>8}")
    print(head)
    table = []
    for r in rows:
        cells = [r["decodes"], r["context"], r["chunk"], r["start"]]
        line = f"{r['decodes']:>3}{r['context']:>6}{r['chunk']:>5}{r['start']:>6}"
        for name in workers:
            x = r[name]
            line += (f"{x['decode_ms']:>8.1f}{x['prefill_ms']:>8.1f}{x['mixed_ms']:>8.1f}"
                     f"{x['mixed_over_sum']:>8.2f}")
            cells += [x["decode_ms"], x["prefill_ms"], x["mixed_ms"], x["mixed_over_sum"]]
        if "base" in workers:
            line += "".join(f"{r[f'{part}_new_over_base']:>8.2f}"
                            for part in ("decode", "prefill", "mixed"))
            cells += [r[f"{part}_new_over_base"] for part in ("decode", "prefill", "mixed")]
        print(line)
        table.append(cells)

    # The cost model, fitted on the new implementation's steps (and the baseline's model,
    # when there is one, on the same steps): how well does it price each kind of step?
    medians = {v: med[(v, "new")] for v in variants}
    models = {"new": load_cost_model(None)}
    if args.baseline:
        models["base"] = load_cost_model(Path(tmp.name) / "src" / "actors" / "cost_model.py")
    fitted = {name: fit_cost_model(cm, medians) for name, cm in models.items()}
    fit = {name: fit_errors(models[name], m, medians) for name, m in fitted.items()}
    for name, f in fit.items():
        print(f"cost model ({name}) fitted on the new steps: coef "
              + ", ".join(f"{c:.4g}" for c in f["coef"]))
        for kind, e in f["rel_error"].items():
            print(f"  {kind:<8} pred/real - 1: median |.| {e['median_abs']:.0%}, "
                  f"max |.| {e['max_abs']:.0%}, mean {e['mean']:+.0%}")

    # The SLO chunker's view: with target = factor x the predicted decode-only step, how
    # many prefill tokens does it give, and what does that step really cost?
    checks = []
    if args.chunker_factors:
        plan = []
        for name, cm in models.items():
            for d, c, s, f in itertools.product(args.decodes, args.contexts, args.starts,
                                                args.chunker_factors):
                target, budget = chunker_budget(cm, fitted[name], d, c, s, f,
                                                min(2048, max_ctx - s))
                plan.append((name, d, c, s, f, target, budget, ("mixed", d, c, budget, s)))
        worker_new = workers["new"]
        todo = sorted({p[-1] for p in plan} | {("decode", d, c, 0, 0) for _, d, c, *_ in plan})
        for v in todo:
            worker_new.step(v)
        check_times: dict[tuple, list[float]] = {v: [] for v in todo}
        for _ in range(max(3, args.reps // 2)):
            shuffler.shuffle(todo)
            for v in todo:
                check_times[v].append(worker_new.step(v))
        cmed = {v: statistics.median(ts) for v, ts in check_times.items()}
        print("\nSLO chunker, target = factor x predicted decode-only step: chunk, real step "
              "/ target, real step / real decode-only step, prefill tok/s")
        print(f"{'model':>6}{'D':>4}{'C':>6}{'S':>6}{'factor':>7}{'target':>8}{'chunk':>6}"
              f"{'real':>8}{'r/tgt':>7}{'r/dec':>7}{'tok/s':>7}")
        for name, d, c, s, f, target, budget, v in plan:
            real, dec = cmed[v], cmed[("decode", d, c, 0, 0)]
            checks.append({"model": name, "decodes": d, "context": c, "start": s, "factor": f,
                           "target_ms": target * 1000, "chunk": budget, "real_ms": real * 1000,
                           "real_over_target": real / target, "real_over_decode": real / dec,
                           "prefill_tok_s": budget / real})
            print(f"{name:>6}{d:>4}{c:>6}{s:>6}{f:>7.2f}{target * 1000:>8.1f}{budget:>6}"
                  f"{real * 1000:>8.1f}{real / target:>7.2f}{real / dec:>7.2f}"
                  f"{budget / real:>7.0f}")

    summary = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": platform.machine(),
        "torch": torch.__version__, "threads": info["threads"], "shape": args.shape,
        "decode_backend": info["backend"], "block_size": args.block_size, "reps": args.reps,
        "baseline": args.baseline, "rows": rows, "cost_model_fit": fit, "chunker": checks,
        "raw_ms": {f"{v[0]} D={v[1]} C={v[2]} P={v[3]} S={v[4]} [{name}]":
                   [t * 1000 for t in ts] for (v, name), ts in times.items()},
    }
    write_raw("mixed_step", summary)
    for w in workers.values():
        w.close()
    tmp.cleanup()
    columns = ["D", "C", "P", "S", "decode ms", "prefill ms", "mixed ms", "mixed / sum"]
    if "base" in workers:
        columns += ["b. decode ms", "b. prefill ms", "b. mixed ms", "b. mixed / sum",
                    "decode new / b.", "prefill new / b.", "mixed new / b."]
    ratios = [r["new"]["mixed_over_sum"] for r in rows]
    headline = {"mixed_over_sum": {"median": statistics.median(ratios), "max": max(ratios)},
                "cost_model_median_abs_error": {k: e["median_abs"] for k, e
                                                in fit["new"]["rel_error"].items()}}
    if "base" in workers:
        headline["mixed_new_over_base_median"] = statistics.median(
            r["mixed_new_over_base"] for r in rows)
    record_run("mixed_step", headline, {"columns": columns, "rows": table}, args)
    return summary


if __name__ == "__main__":
    main()
