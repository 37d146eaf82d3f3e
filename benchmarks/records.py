"""One record per benchmark run: what was measured, on which machine, at which commit.

Every script ends with `record_run(script, summary, table, args)`, which writes
benchmarks/results/<script>/<YYYY-MM-DD>-<machine kind>.json (`-2`, `-3` ... beside a run of
the same day and kind, never over it) holding the script, the UTC time, the commit (with a
`dirty` flag for uncommitted changes to tracked files), the machine's facts, the script's
arguments, a small `summary` (headline figures and ratios) and the `table` the script
printed, {"columns": [...], "rows": [[...], ...]}, which benchmarks/report.py renders into
benchmarks/README.md. Records are committed; a smoke run's (`smoke=True`: a --quick whose
numbers mean nothing) goes to benchmarks/raw/smoke/ instead.

A script's full output (every round, per-request figures), where it keeps one, goes to
benchmarks/raw/<script>.json (`write_raw`), which git ignores.

The machine kind (`machine_kind`) names a kind of machine, the same across runs on it:
vendor, family and best ISA tier (amd-epyc-avx2, amd-epyc-avx512, intel-xeon-amx), then the
GPU where CUDA has one (-h100). Nothing but the standard library is imported at module
level: gpu_check.py loads this file on a GPU host.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
RAW = HERE / "raw"
# The instruction sets the CPU kernels care about, as /proc/cpuinfo spells them.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_bf16", "amx_int8")
VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}
MAX_RECORD_BYTES = 16_000   # "a few KB": a bigger record has per-request data in it


# -- the machine ------------------------------------------------------------------------------
def parse_cpuinfo(text: str) -> dict:
    """{"model", "vendor", "isa"} of /proc/cpuinfo's first processor; `isa`: the ISA_FLAGS
    present, in that order."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"model": fields.get("model name", ""), "vendor": fields.get("vendor_id", ""),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def gpu_kind(name: str | None) -> str | None:
    """"NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx4090"."""
    if not name:
        return None
    words = [w for w in re.split(r"[\s_-]+", name.lower())
             if w and w not in ("nvidia", "geforce", "tesla", "amd", "radeon")]
    out = []
    for w in words:
        out.append(re.sub(r"[^a-z0-9]", "", w))
        if any(c.isdigit() for c in w):
            break
    return "".join(out) or None


def machine_kind(cpu: dict, arch: str = "x86_64", gpu: str | None = None) -> str:
    """Vendor, family and best ISA tier of `cpu` (parse_cpuinfo's), then the GPU's kind."""
    vendor = VENDORS.get(cpu["vendor"]) or re.sub(r"[^a-z0-9]", "", cpu["vendor"].lower())
    words = re.sub(r"\((r|tm)\)", " ", cpu["model"].lower()).split()
    family = next((re.sub(r"[^a-z0-9]", "", w) for w in words
                   if w not in (vendor, "cpu") and w.isalpha()), "")
    isa = set(cpu["isa"])
    tier = ("amx" if "amx_tile" in isa else "avx512" if "avx512f" in isa
            else "avx2" if "avx2" in isa else "")
    parts = [vendor or arch, family, tier, gpu_kind(gpu)]
    return "-".join(p for p in parts if p)


def read_bandwidth_gbs() -> float:
    """Multi-threaded memory read bandwidth in GB/s: sum a 1 GiB fp32 tensor, best of 5
    (a few hundred ms). In a child process: OpenMP work on this thread would give the
    process a second OpenMP team beside an engine's compute thread, and libgomp then stops
    busy-waiting (actors/execution/compute_thread.py), doubling the engine's step time."""
    code = ("import time, torch\n"
            "a = torch.ones(256 * 1024 * 1024); a.sum()\n"
            "best = float('inf')\n"
            "for _ in range(5):\n"
            "    t = time.perf_counter(); a.sum(); best = min(best, time.perf_counter() - t)\n"
            "print(a.numel() * 4 / best / 1e9)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_facts(bandwidth_gbs: float | None = None) -> dict:
    """This machine's facts; `bandwidth_gbs`: a read bandwidth the script measured already
    (else it is measured here)."""
    cpu = parse_cpuinfo(_read("/proc/cpuinfo"))
    mem = re.search(r"MemTotal:\s+(\d+) kB", _read("/proc/meminfo"))
    nodes = Path("/sys/devices/system/node")
    torch_version = gpu = threads = None
    try:
        import torch
        torch_version, threads = torch.__version__, torch.get_num_threads()
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    if bandwidth_gbs is None:
        try:
            bandwidth_gbs = read_bandwidth_gbs()
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            bandwidth_gbs = None
    return {
        "kind": machine_kind(cpu, platform.machine(), gpu),
        "cpu": cpu["model"] or platform.processor() or platform.machine(),
        "vendor": cpu["vendor"], "arch": platform.machine(), "isa": cpu["isa"],
        "logical_cores": os.cpu_count(),
        "affinity_cores": (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                           else os.cpu_count()),
        "numa_nodes": (len(list(nodes.glob("node[0-9]*"))) or None) if nodes.is_dir() else None,
        "memory_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "read_bandwidth_gbs": round(bandwidth_gbs, 1) if bandwidth_gbs else None,
        "torch": torch_version, "torch_threads": threads, "gpu": gpu,
    }


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD, whether tracked files differ from it); outside a git checkout (a copy of the
    tree on a GPU host) the commit is $TOKENLOOM_COMMIT, if set, and dirty is unknown."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              check=True, timeout=60).stdout
    try:
        return git("rev-parse", "HEAD").strip(), bool(git("status", "--porcelain",
                                                          "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("TOKENLOOM_COMMIT"), None


# -- the record -------------------------------------------------------------------------------
def make_table(columns, rows) -> dict:
    """A record's table; every row has one cell per column (str, number, bool or None)."""
    columns, rows = [str(c) for c in columns], [list(r) for r in rows]
    for r in rows:
        if len(r) != len(columns):
            raise ValueError(f"a row of {len(r)} cells under {len(columns)} columns: {r}")
    return {"columns": columns, "rows": rows}


def _rounded(obj):
    """Floats to 4 significant digits (a record states figures, not noise), recursively;
    anything JSON cannot hold as it is (paths, tuples' elements...) as its str."""
    if isinstance(obj, float):
        return float(f"{obj:.4g}") if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {str(k): _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def record_run(script: str, summary: dict, table: dict, args=None, *,
               bandwidth_gbs: float | None = None, machine: dict | None = None,
               smoke: bool = False, results_dir: Path | None = None,
               now: dt.datetime | None = None) -> Path:
    """Write this run's record (see the module's docstring) and return its path. `args`:
    the script's parsed arguments (a Namespace or a dict); `bandwidth_gbs`: a read
    bandwidth the script measured (else measured here); `machine`: facts gathered already;
    `smoke`: a run whose numbers mean nothing (its record goes to benchmarks/raw/smoke/)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    machine = machine or machine_facts(bandwidth_gbs)
    commit, dirty = git_commit()
    if args is not None and not isinstance(args, dict):
        args = vars(args)
    record = {"script": script, "date": now.isoformat(timespec="seconds"), "commit": commit,
              "dirty": dirty, "machine": machine, "args": _rounded(args or {}),
              "summary": _rounded(summary), "table": _rounded(make_table(**table))}
    text = _compact(json.dumps(record, indent=1, ensure_ascii=False)) + "\n"
    folder = Path(results_dir or (RAW / "smoke" if smoke else RESULTS)) / script
    folder.mkdir(parents=True, exist_ok=True)
    stem, n = f"{now:%Y-%m-%d}-{machine['kind']}", 1
    while True:
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with open(path, "x") as f:
                f.write(text)
            break
        except FileExistsError:
            n += 1
    if len(text) > MAX_RECORD_BYTES:
        print(f"warning: {path} is {len(text)} bytes: keep per-request figures out of the "
              f"summary and table (write_raw)", file=sys.stderr)
    where = "smoke run, not for committing: " if smoke and results_dir is None else ""
    print(f"recorded {where}{_shown(path)}")
    return path


def _compact(text: str) -> str:
    """indent=1 JSON with every array of plain values on one line (a table row, the ISA
    flags), so that a record reads like the table it holds. Only arrays whose text holds no
    bracket or brace at all are joined (JSON strings hold no raw newline)."""
    return re.sub(r"\[\n\s*([^\[\]{}]*?)\n\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",\n")) + "]",
                  text)


def write_raw(script: str, obj, **kw) -> Path:
    """A script's full output at benchmarks/raw/<script>.json (ignored by git; each run
    rewrites it). `kw` goes to json.dumps."""
    path = RAW / f"{script}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str, **kw))
    return path


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


RECORD_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.json$")


def load_records(results_dir: Path = RESULTS) -> list[tuple[Path, dict]]:
    """Every record under `results_dir` (<script>/<date>-<kind>.json; other files, such as
    `make gpu-check`'s own output there, are not records), oldest first."""
    found = [(p, json.loads(p.read_text())) for p in Path(results_dir).glob("*/*.json")
             if RECORD_NAME.match(p.name)]
    return sorted(found, key=lambda pr: (pr[1]["date"], pr[0].parent.name, _sequence(*pr)))


def _sequence(path: Path, record: dict) -> tuple[int, str]:
    """A record's place among its day's runs on its kind of machine: 1, then the -N suffix."""
    base = f"{record['date'][:10]}-{record['machine']['kind']}"
    rest = path.stem[len(base) + 1:] if path.stem.startswith(base + "-") else ""
    return (int(rest) if rest.isdigit() else 1), path.name
