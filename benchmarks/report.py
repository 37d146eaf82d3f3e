"""Writes benchmarks/README.md from the run records in benchmarks/results/ (records.py).

    python benchmarks/report.py            # regenerate benchmarks/README.md
    python benchmarks/report.py --check    # exit 1 if the file differs from what it would be

One section per benchmark, in GROUPS' order: what it measures (the first paragraph of its
docstring: one source), how to run it, the latest run per machine kind as a table (with
the machine, date and commit) and every run as one line with its headline summary. The
output depends on the records and the scripts alone (no generation time), so --check holds
until a record or a docstring changes.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from records import RESULTS, load_records

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"


@dataclass(frozen=True)
class Section:
    name: str            # the records' `script`, and the section's heading
    file: str = ""       # the script (default: <name>.py)
    function: str = ""   # whose docstring describes it (default: the module's)
    run: str = ""        # how to run it (default: the docstring's `python benchmarks/...` lines)

    @property
    def path(self) -> str:
        return self.file or f"{self.name}.py"


GROUPS = (
    ("The CPU forward, kernel by kernel and whole", (
        Section("gemv_kernels"), Section("onednn_shapes"), Section("decode_step"),
        Section("decode_team"), Section("prefill_step"), Section("mixed_step"),
        Section("cpu_forward"), Section("offline"), Section("family_step"))),
    ("Serving", (
        Section("serve"),
        Section("serve_shared_prefix", "serve.py", "shared_prefix_main",
                "python benchmarks/serve.py --shared-prefix"),
        Section("interference"), Section("engine_loop"), Section("hops"),
        Section("prefix_routing"), Section("disagg"), Section("kv_tiers"), Section("kv_quant"),
        Section("hybrid_kv"), Section("lora"), Section("speculative"), Section("structured"),
        Section("agent_apis"),
        Section("vllm_cpu"))),
    ("On a GPU", (Section("gpu_check"),)),
    ("Robustness", (Section("soak"), Section("fuzz_api"))),
)
# The other modules here, and what they are.
MODULES = {
    "harness.py": "servers, models and the load generator every script shares",
    "records.py": "the run record every script writes, with the machine's facts",
    "report.py": "writes this file from the records",
    "gpu_engine.py": "gpu_check's engine part: the real engine, offline and over HTTP",
    "gpu_mixed.py": "gpu_check's mixed prefill+decode steps, eager against piecewise graphs",
}


# -- text from the scripts --------------------------------------------------------------------
def docstring(path: Path, function: str = "") -> str:
    tree = ast.parse(path.read_text())
    if function:
        tree = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return ast.get_docstring(tree) or ""


def purpose(doc: str) -> str:
    """The docstring's first paragraph, as one line."""
    return " ".join(doc.split("\n\n")[0].split())


def run_lines(doc: str) -> list[str]:
    """The docstring's indented example commands (`python benchmarks/...`), each with the
    more indented lines that continue it."""
    out: list[str] = []
    depth = None
    for line in doc.splitlines():
        indent = len(line) - len(line.lstrip())
        if indent and re.search(r"\bpython3? benchmarks/\w+\.py", line):
            out.append(line.strip())
            depth = indent
        elif depth is not None and indent > depth and line.strip():
            out[-1] += "\n" + " " * (indent - depth) + line.strip()
        else:
            depth = None
    return out


# -- figures ----------------------------------------------------------------------------------
def fmt(v) -> str:
    """A figure as the tables show it."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.0f}"
        if a >= 10:
            return f"{v:.1f}"
        return f"{v:.2f}" if a >= 1 or a == 0 else f"{v:.3g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(", ", ": "))
    return str(v)


def _cell(v) -> str:
    return fmt(v).replace("|", "\\|").replace("\n", " ")


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def markdown_table(table: dict) -> list[str]:
    """A record's table in markdown; columns of numbers only are right-aligned."""
    cols, rows = table["columns"], table["rows"]
    align = ["---:" if rows and all(_numeric(r[i]) or r[i] is None for r in rows)
             and any(_numeric(r[i]) for r in rows) else "---" for i in range(len(cols))]
    lines = ["| " + " | ".join(_cell(c) for c in cols) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in r) + " |" for r in rows]
    return lines


def flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += flatten(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def commit_of(record: dict) -> str:
    short = (record.get("commit") or "unknown")[:10]
    return f"`{short}`" + (" (uncommitted changes)" if record.get("dirty") else "")


def machine_line(m: dict) -> str:
    cores = (f"{m['affinity_cores']} of {m['logical_cores']} cores"
             if m.get("affinity_cores") != m.get("logical_cores") else
             f"{m.get('logical_cores')} cores")
    parts = [m.get("cpu") or "?", cores]
    if m.get("read_bandwidth_gbs"):
        parts.append(f"{fmt(m['read_bandwidth_gbs'])} GB/s read")
    if m.get("gpu"):
        parts.append(m["gpu"])
    return ", ".join(parts)


# -- the page ---------------------------------------------------------------------------------
HEADER = """\
# Benchmarks

<!-- Generated by benchmarks/report.py from benchmarks/results/: edit the scripts'
docstrings, the records or report.py, not this file. -->

The scripts in this folder measure tokenloom's speed and resource use on a real machine:
benchmarks, not tests (nothing in the test suite times anything). **Every figure is a ratio
against a baseline measured side by side in the same run**: another engine, another setting
of the same engine, or the machine's own roofline. A shared machine's speed drifts by tens
of percent within minutes: compare ratios, never absolute numbers across runs or machines.

- Run one: `.venv/bin/python benchmarks/<script>.py` (`--help` lists its options; most have a
  `--quick` smoke setting), one at a time, on a quiet machine.
- Each run writes one record, `benchmarks/results/<script>/<date>-<machine kind>.json`
  ([records.py](records.py)): the machine's facts (CPU, ISA flags, cores, NUMA nodes, memory,
  a measured read bandwidth, torch, GPU), the commit, the arguments, a headline summary and
  the table shown here. Commit it. A smoke run's record, and a script's full output (every
  round, per-request figures), go to benchmarks/raw/ instead, which git ignores.
- Then regenerate this file: `.venv/bin/python benchmarks/report.py` (`--check` exits 1 when
  it is stale; [test_report.py](../tests/benchmarks/test_report.py) runs that check).
- Figures from before results were committed: `git log -p benchmarks/README.md`.
"""


def render(results_dir: Path | None = None, bench_dir: Path | None = None) -> str:
    """The page for the records in `results_dir` (default benchmarks/results/) and the
    scripts in `bench_dir` (default benchmarks/)."""
    bench_dir = bench_dir or HERE
    records = load_records(results_dir or RESULTS)
    by_script: dict[str, list[dict]] = {}
    for _, r in records:
        by_script.setdefault(r["script"], []).append(r)
    out = [HEADER]
    out += _machines([r for _, r in records])
    out += ["## Contents", ""]
    for title, sections in GROUPS:
        out.append(f"- {title}: " + ", ".join(f"[{s.name}](#{s.name})" for s in sections))
    out.append("- Other modules: " + "; ".join(f"[{name}]({name}) ({what})"
                                               for name, what in MODULES.items()))
    out.append("")
    known = set()
    for title, sections in GROUPS:
        out += [f"## {title}", ""]
        for s in sections:
            known.add(s.name)
            out += _section(s, bench_dir, by_script.get(s.name, []))
    others = sorted(set(by_script) - known)
    if others:
        out += ["## Records of no known script", ""]
        for name in others:
            out += _section(Section(name), bench_dir, by_script[name])
    return "\n".join(out).rstrip("\n") + "\n"


def _machines(records: list[dict]) -> list[str]:
    if not records:
        return []
    latest = {r["machine"]["kind"]: r["machine"] for r in records}
    lines = ["## Machines", "",
             "The machines of the runs below, as their newest record describes them.", "",
             "| machine kind | CPU | ISA flags | cores (usable / logical) | NUMA nodes | memory "
             "| torch | GPU |", "|---|---|---|---|---|---|---|---|"]
    for kind in sorted(latest):
        m = latest[kind]
        lines.append("| " + " | ".join(_cell(v) for v in (
            kind, m.get("cpu"), " ".join(m.get("isa") or []) or "-",
            f"{m.get('affinity_cores')} / {m.get('logical_cores')}", m.get("numa_nodes"),
            f"{fmt(m['memory_gib'])} GiB" if m.get("memory_gib") else None, m.get("torch"),
            m.get("gpu"))) + " |")
    return lines + [""]


def _section(s: Section, bench_dir: Path, runs: list[dict]) -> list[str]:
    path = bench_dir / s.path
    doc = docstring(path, s.function) if path.exists() else ""
    lines = [f"### {s.name}", "", f"[{s.path}]({s.path}): {purpose(doc) or '(no docstring)'}",
             "", "Run:", "", "```sh"]
    lines += [s.run] if s.run else (run_lines(doc) or [f"python benchmarks/{s.path}"])
    lines += ["```", ""]
    if not runs:
        return lines + ["No committed run yet.", ""]
    latest = {r["machine"]["kind"]: r for r in runs}
    for kind in sorted(latest):
        r = latest[kind]
        lines += [f"Latest on **{kind}**: {r['date'][:10]}, commit {commit_of(r)}; "
                  f"{machine_line(r['machine'])}.", ""]
        lines += markdown_table(r["table"]) if r["table"]["rows"] else ["(no table rows)"]
        lines.append("")
    lines += ["History (newest first):", ""]
    for r in reversed(runs):
        summary = "; ".join(f"{k}={fmt(v)}" for k, v in flatten(r.get("summary") or {}))
        lines.append(f"- {r['date'][:10]} {r['machine']['kind']} {commit_of(r)}: "
                     f"{summary or '(no summary)'}")
    return lines + [""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if benchmarks/README.md differs from what would be written")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not README.exists() or README.read_text() != text:
            print("benchmarks/README.md is stale: run python benchmarks/report.py")
            return 1
        return 0
    README.write_text(text)
    print(f"wrote {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
