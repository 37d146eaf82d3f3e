"""CPU feature detection: parsing /proc/cpuinfo text, the torch-capability fallback, and
that detection never fails on a machine lacking every feature."""

from __future__ import annotations

from tokenloom.kernels.cpu import features as cpu_features
from tokenloom.kernels.cpu.features import CpuFeatures, from_torch_capability, parse_cpuinfo

ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B45
flags\t\t: fpu sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 \
avx_vnni avx512_vnni
processor\t: 1
model name\t: ignored second entry
flags\t\t: fpu
"""
SAPPHIRE = ("model name: Xeon\n"
            "flags: avx2 fma avx512f avx512bw avx512vl amx_tile amx_bf16 amx_int8\n")
OLD = "model name: Old\nflags: fpu sse sse2\n"


def test_parse_zen5_flags():
    model, flags = parse_cpuinfo(ZEN5)
    assert model == "AMD EPYC 9B45"
    f = CpuFeatures("x86_64", model, flags, "AVX512")
    assert f.avx2 and f.avx512 and f.bf16 and f.vnni and not f.amx
    assert f.summary() == "x86_64 avx2 avx512 avx512_bf16 vnni (torch AVX512)"


def test_amx_counts_as_bf16():
    f = CpuFeatures("x86_64", *parse_cpuinfo(SAPPHIRE), "AVX512")
    assert f.amx and f.bf16 and "avx512_bf16" not in f.flags


def test_cpu_without_any_feature():
    f = CpuFeatures("x86_64", *parse_cpuinfo(OLD), "DEFAULT")
    assert not (f.avx2 or f.avx512 or f.bf16 or f.vnni or f.amx)
    assert f.summary() == "x86_64 (torch DEFAULT)"
    assert parse_cpuinfo("") == ("", frozenset())


def test_torch_capability_fallback():
    assert from_torch_capability("DEFAULT") == frozenset()
    assert "avx2" in from_torch_capability("AVX2")
    assert {"avx2", "avx512f"} <= from_torch_capability("AVX512")


def test_detect_never_raises(tmp_path):
    cpu_features.detect.cache_clear()
    try:
        f = cpu_features.detect(str(tmp_path / "missing"))   # no /proc/cpuinfo: torch's view
        assert f.torch_capability
        assert isinstance(f.summary(), str)
    finally:
        cpu_features.detect.cache_clear()
    here = cpu_features.detect()
    if here.torch_capability.startswith("AVX512"):
        assert here.avx512
