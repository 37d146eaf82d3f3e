"""Benchmark results are committed records, and benchmarks/README.md is generated from them:
1. the README is exactly what benchmarks/report.py writes from benchmarks/results/, and every
   script in benchmarks/ has a section there (or is named as a shared module);
2. the machine kind in a record's file name comes from /proc/cpuinfo: vendor, family and
   best ISA tier (AVX2-only AMD, AVX-512 AMD, Intel with AMX), plus the GPU;
3. `record_run` writes one small JSON per run and never overwrites one (`-2`, `-3`...);
4. the renderer shows each machine kind's latest run as a table and every run as a line,
   and a script without a record as such, the same way every time.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import records  # noqa: E402
import report  # noqa: E402

# The first processor of /proc/cpuinfo on three kinds of machine (flags shortened).
MILAN = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx fma f16c avx2 bmi2 sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu avx512f amx_tile
"""
GENOA = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B14
flags\t\t: fpu avx fma f16c avx2 avx512f avx512dq avx512_bf16 avx512_vnni avx512vl
"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu avx fma f16c avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
CPU implementer\t: 0x41
"""


def test_readme_is_what_report_generates():
    """Regenerate it with `python benchmarks/report.py` after adding a record."""
    assert (BENCH / "README.md").read_text() == report.render(), \
        "benchmarks/README.md is stale: run python benchmarks/report.py"
    assert report.main(["--check"]) == 0


def test_every_script_has_a_section_or_is_a_shared_module():
    named = {s.path for _, sections in report.GROUPS for s in sections} | set(report.MODULES)
    assert {p.name for p in BENCH.glob("*.py")} <= named
    for _, sections in report.GROUPS:
        for s in sections:
            assert (BENCH / s.path).is_file(), s
            assert report.purpose(report.docstring(BENCH / s.path, s.function)), s


def test_committed_records_are_small_and_complete():
    for path, r in records.load_records():
        assert path.parent.name == r["script"] and path.stat().st_size < 16_000, path
        assert {"date", "commit", "dirty", "machine", "args", "summary", "table"} <= set(r)
        assert path.name.startswith(r["date"][:10] + "-" + r["machine"]["kind"]), path


@pytest.mark.parametrize("text, kind, isa", [
    (MILAN, "amd-epyc-avx2", ["avx2", "fma", "f16c"]),
    (GENOA, "amd-epyc-avx512", ["avx2", "fma", "f16c", "avx512f", "avx512_vnni",
                                "avx512_bf16"]),
    (SAPPHIRE_RAPIDS, "intel-xeon-amx", ["avx2", "fma", "f16c", "avx512f", "avx512_vnni",
                                         "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]),
    (GRAVITON, "aarch64", []),
])
def test_machine_kind_from_cpuinfo(text, kind, isa):
    cpu = records.parse_cpuinfo(text)
    assert cpu["isa"] == isa                      # the first processor's, in ISA_FLAGS order
    arch = "aarch64" if text is GRAVITON else "x86_64"
    assert records.machine_kind(cpu, arch) == kind


def test_machine_kind_names_the_gpu():
    cpu = records.parse_cpuinfo(GENOA)
    assert records.machine_kind(cpu, gpu="NVIDIA H100 80GB HBM3") == "amd-epyc-avx512-h100"
    assert records.gpu_kind("NVIDIA A100-SXM4-80GB") == "a100"
    assert records.gpu_kind("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert records.gpu_kind(None) is None


MACHINE = {"kind": "amd-epyc-avx2", "cpu": "AMD EPYC 7B13", "vendor": "AuthenticAMD",
           "arch": "x86_64", "isa": ["avx2", "fma", "f16c"], "logical_cores": 2,
           "affinity_cores": 2, "numa_nodes": 1, "memory_gib": 7.8, "read_bandwidth_gbs": 21.5,
           "torch": "2.13.0", "torch_threads": 2, "gpu": None}


def _record(tmp_path, script="decode_team", when="2025-06-01T10:00:00", machine=MACHINE,
            summary=None, rows=None, **kw) -> Path:
    rows = rows if rows is not None else [["q4-kv16", 10.123456, 1.5]]
    return records.record_run(script, summary or {"q4-kv16_median_ratio": 1.234567},
                              {"columns": ["mode", "team ms", "ratio"], "rows": rows},
                              {"modes": ["q4-kv16"], "out": Path("/x")}, machine=machine,
                              results_dir=tmp_path, now=dt.datetime.fromisoformat(when)
                              .replace(tzinfo=dt.timezone.utc), **kw)


def test_record_run_writes_one_small_record_per_run(tmp_path):
    first = _record(tmp_path)
    assert first == tmp_path / "decode_team" / "2025-06-01-amd-epyc-avx2.json"
    r = json.loads(first.read_text())
    assert r["script"] == "decode_team" and r["date"] == "2025-06-01T10:00:00+00:00"
    assert len(r["commit"]) == 40 and isinstance(r["dirty"], bool)
    assert r["machine"] == MACHINE and r["args"] == {"modes": ["q4-kv16"], "out": "/x"}
    assert r["summary"] == {"q4-kv16_median_ratio": 1.235}       # 4 significant digits
    assert r["table"] == {"columns": ["mode", "team ms", "ratio"],
                          "rows": [["q4-kv16", 10.12, 1.5]]}
    # The same day and kind again: a new file beside it, never over it.
    assert _record(tmp_path).name == "2025-06-01-amd-epyc-avx2-2.json"
    assert _record(tmp_path).name == "2025-06-01-amd-epyc-avx2-3.json"
    assert json.loads(first.read_text()) == r
    assert [p.name for p, _ in records.load_records(tmp_path)] == [
        "2025-06-01-amd-epyc-avx2.json", "2025-06-01-amd-epyc-avx2-2.json",
        "2025-06-01-amd-epyc-avx2-3.json"]


def test_record_run_refuses_a_ragged_table(tmp_path):
    with pytest.raises(ValueError, match="2 cells under 3 columns"):
        _record(tmp_path, rows=[["q4", 1.0]])
    assert not list(tmp_path.rglob("*.json"))


def test_a_smoke_runs_record_stays_out_of_the_results(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RAW", tmp_path / "raw")
    monkeypatch.setattr(records, "RESULTS", tmp_path / "results")
    path = records.record_run("hops", {}, {"columns": ["a"], "rows": []}, machine=MACHINE,
                              smoke=True)
    assert path.parent == tmp_path / "raw" / "smoke" / "hops"
    assert not (tmp_path / "results").exists()
    assert records.write_raw("hops", {"x": 1}) == tmp_path / "raw" / "hops.json"


def test_files_that_are_not_records_are_skipped(tmp_path):
    _record(tmp_path, script="gpu_check")
    (tmp_path / "gpu_check" / "gpu_check.json").write_text('{"mode": "gpu"}')
    assert [r["script"] for _, r in records.load_records(tmp_path)] == ["gpu_check"]


def test_machine_facts_of_this_machine():
    m = records.machine_facts(bandwidth_gbs=12.345)   # (no bandwidth measured here)
    assert m["kind"] and m["logical_cores"] >= 1 and 1 <= m["affinity_cores"]
    assert m["read_bandwidth_gbs"] == 12.3 and m["torch"]
    assert set(m["isa"]) <= set(records.ISA_FLAGS)


def test_render_shows_the_latest_run_per_machine_and_every_run(tmp_path):
    genoa = {**MACHINE, "kind": "amd-epyc-avx512", "cpu": "AMD EPYC 9B14",
             "isa": ["avx2", "avx512f"], "affinity_cores": 4, "logical_cores": 8}
    _record(tmp_path, when="2025-06-01T10:00:00", rows=[["q4-kv16", 11.0, 1.25]],
            summary={"q4-kv16_median_ratio": 1.25})
    _record(tmp_path, when="2025-06-03T10:00:00", rows=[["q4-kv16", 9.5, 1.5]],
            summary={"q4-kv16_median_ratio": 1.5, "note": "a|b"})
    _record(tmp_path, when="2025-06-02T10:00:00", machine=genoa, rows=[["q4-kv16", 4.0, 2.0]],
            summary={"q4-kv16_median_ratio": 2.0})
    text = report.render(tmp_path)
    assert text == report.render(tmp_path)                       # no generation time
    section = text.split("### decode_team\n")[1].split("\n### ")[0]
    assert "One OpenMP team per decode step against one team per kernel" in section
    assert "python benchmarks/decode_team.py" in section
    # The latest run of each kind as a table (kinds sorted), numbers right-aligned.
    avx2, avx512 = section.index("Latest on **amd-epyc-avx2**: 2025-06-03"), \
        section.index("Latest on **amd-epyc-avx512**: 2025-06-02")
    assert avx2 < avx512 and "AMD EPYC 9B14, 4 of 8 cores, 21.5 GB/s read" in section
    assert "| mode | team ms | ratio |\n|---|---:|---:|\n| q4-kv16 | 9.50 | 1.50 |" in section
    assert "| q4-kv16 | 11.0 | 1.25 |" not in section             # older: history only
    # Every run, newest first, with its headline summary.
    history = [line for line in section.splitlines() if line.startswith("- 2025-")]
    assert [h[:13] for h in history] == ["- 2025-06-03 ", "- 2025-06-02 ", "- 2025-06-01 "]
    assert "q4-kv16_median_ratio=1.50; note=a|b" in history[0]
    assert "amd-epyc-avx512" in history[1] and "q4-kv16_median_ratio=2.00" in history[1]
    # The machines' table, and a script without a record.
    assert "| amd-epyc-avx512 | AMD EPYC 9B14 | avx2 avx512f | 4 / 8 |" in text
    gemv = text.split("### gemv_kernels\n")[1].split("\n### ")[0]
    assert "No committed run yet." in gemv and "Latest on" not in gemv


def test_check_fails_on_a_stale_readme(tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    assert report.main(["--check"]) == 1                         # missing
    assert report.main([]) == 0 and report.main(["--check"]) == 0
    _record(tmp_path / "results")
    assert report.main(["--check"]) == 1                         # a new record
    assert "stale" in capsys.readouterr().out


def test_figures_are_formatted_for_reading():
    assert [report.fmt(v) for v in (None, True, 3, 1234.5, 123.4, 12.34, 1.234, 0.01234, 0.0)] \
        == ["-", "yes", "3", "1,234", "123", "12.3", "1.23", "0.0123", "0.00"]
    assert report.markdown_table({"columns": ["a|b", "n"], "rows": [["x|y", None]]}) == [
        "| a\\|b | n |", "|---|---|", "| x\\|y | - |"]
