"""The tests whose outcome depends on the CPU's instruction set (marked ``kernels``: our kernels,
and the layer against the stock module, whose rounding comes from PyTorch's own vectorized
code and BLAS) once more under each instruction set below the machine's best. The default run
tests the best (AVX-512 where the CPU has it, else AVX2); each lower set runs in a process of
its own, set up as a machine of that class runs: ATTN_EXPORT_CPU_ISA lowers our kernels (the
attention core's and the projections' micro-kernels), ATEN_CPU_CAPABILITY PyTorch's kernels,
ONEDNN_MAX_CPU_ISA oneDNN's, MKL_ENABLE_INSTRUCTIONS MKL's and OPENBLAS_CORETYPE OpenBLAS's.
An AVX-512 machine thus tests AVX-512, AVX2 and the generic code; an AVX2 machine AVX2 and the
generic code. What no variable lowers: ONNX Runtime's kernels (MLAS picks its own from the
CPU), and code a compiler specialised for the build machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # make test-fast leaves it out


def cpu_flags() -> set:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def lower_isas(flags) -> list:
    """The instruction sets below the best one the kernels pick on a CPU with these flags
    (csrc/kernels/cpu/flash_cpu.cpp: detect_isa)."""
    avx2 = {"avx2", "fma"} <= flags
    avx512 = avx2 and {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags
    return (["generic"] if avx2 else []) + (["avx2"] if avx512 else [])


def test_lower_isas_follow_the_kernels_choice():
    assert lower_isas(set()) == []
    assert lower_isas({"avx2", "fma"}) == ["generic"]
    assert lower_isas({"avx2", "fma", "avx512f", "avx512vl", "avx512bw", "avx512dq"}) == ["generic", "avx2"]
    assert lower_isas({"avx2", "fma", "avx512f"}) == ["generic"]  # AVX-512 without VL/BW/DQ: AVX2 is best


LOWER = lower_isas(cpu_flags())

# The environment of a machine whose best instruction set is the key.
MACHINE_CLASS = {
    "avx2": {"ATTN_EXPORT_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"},
    "generic": {"ATTN_EXPORT_CPU_ISA": "generic", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OPENBLAS_CORETYPE": "Nehalem"},
}

# What a process reports it runs with: the attention core's kernels, the projections'
# micro-kernels (None: none run, BLAS takes every product), PyTorch's kernels, OpenBLAS's.
_REPORT = """
import ctypes, json, torch
from attn_export import _C
from attn_export.ops import gemm
flash = ctypes.CDLL(_C.__file__).attn_export_flash_isa
flash.restype = ctypes.c_char_p
print(json.dumps({"core": flash().decode(), "projections": gemm.gemm_backend().microkernel,
                  "torch": torch.backends.cpu.get_cpu_capability(), "openblas": gemm.openblas_config(),
                  "no_microkernels": gemm.available_backends()["microkernel"]}))
"""

# What each class runs: (core, projections, torch, OpenBLAS's core where OpenBLAS is loaded).
EXPECTED = {"avx2": ("avx2", "avx2", "AVX2", "Haswell"), "generic": ("generic", None, "DEFAULT", "Nehalem")}


def machine_report(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _REPORT], capture_output=True, text=True, timeout=300, env=env,
                         check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not LOWER, reason="this CPU runs only the generic kernels, which the default run tests")
@pytest.mark.parametrize("isa", LOWER)
def test_a_lowered_process_runs_that_class_of_machine_everywhere(isa):
    report = machine_report({**os.environ, **MACHINE_CLASS[isa]})
    core, projections, torch_capability, openblas_core = EXPECTED[isa]
    assert (report["core"], report["projections"], report["torch"]) == (core, projections, torch_capability), report
    if report["openblas"]:
        assert f" {openblas_core} " in report["openblas"], report
    # Forcing ATTN_EXPORT_GEMM=microkernel in a generic process is refused naming the variable.
    assert (report["no_microkernels"] == "") == (projections is not None), report
    assert ("ATTN_EXPORT_CPU_ISA=generic" in report["no_microkernels"]) == (isa == "generic"), report
    # An unset limit runs the best: the same report with no variable set names a higher set.
    best = machine_report({k: v for k, v in os.environ.items() if k not in MACHINE_CLASS[isa]})
    assert best["core"] != core and best["torch"] != torch_capability, best


# The stock module's full product of configurations, mask kinds and weights (288 tests, the largest
# share of a lower set's run) runs at the best set only; at the lower ones its every-value subset does
# (test_module_conformance.py: each configuration, mask kind and weight once), beside every test
# of our kernels.
LOWER_ISAS_SKIP = "test_matches_stock_module_full_sweep"


# The kernel tests each lower set runs, in two parts, each a list of (marker expression, folders,
# share): the fast tier's tests of the attention core and the CPU kernels (every kernel path, mask
# kind, dtype and head dim), half of them (a hash of the test's id, tests/conftest.py; the
# other half at the next lower set, so an AVX-512 machine runs every one once), which CI runs; and
# the rest, which `make test-all` adds: the other half, their slow tests (the property search, the
# larger sweeps) and the layer against the stock module.
CORE = ["tests/ops/core", "tests/ops/cpu"]


def scopes(isa: str):
    half = LOWER.index(isa) % 2
    return {
        "core": [("kernels and not slow", CORE, f"{half}/2")],
        "rest": [("kernels and not slow", CORE, f"{1 - half}/2"), ("kernels and slow", CORE, None),
                 ("kernels", ["tests/ops/module"], None)],
    }


@pytest.mark.skipif(not LOWER, reason="this CPU runs only the generic kernels, which the default run tests")
@pytest.mark.parametrize("scope", [pytest.param("core"), pytest.param("rest", marks=pytest.mark.exhaustive)])
@pytest.mark.parametrize("isa", LOWER)
def test_kernel_tests_under_a_lower_instruction_set(isa, scope):
    root = Path(__file__).resolve().parents[3]
    for markers, folders, share in scopes(isa)[scope]:
        env = {**os.environ, **MACHINE_CLASS[isa], **({"ATTN_EXPORT_TEST_SHARD": share} if share else {})}
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", markers,
             "-k", f"not {LOWER_ISAS_SKIP}", *folders],
            capture_output=True, text=True, timeout=1200, cwd=root, env=env)
        _check_run(proc)


def _check_run(proc) -> None:
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
