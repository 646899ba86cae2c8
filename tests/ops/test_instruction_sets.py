"""The CPU kernels' tests (marked ``kernels``) once more under each instruction set below the
machine's best: the default run tests the best (AVX-512 where the CPU has it, else AVX2), and
ATTN_EXPORT_CPU_ISA, read once per process, lowers it, so each lower set runs in a process of
its own. An AVX-512 machine thus tests AVX-512, AVX2 and the generic code; an AVX2 machine
AVX2 and the generic code."""
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


@pytest.mark.skipif(not LOWER, reason="this CPU runs only the generic kernels, which the default run tests")
@pytest.mark.parametrize("isa", LOWER)
def test_kernel_tests_under_a_lower_instruction_set(isa):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-m", "kernels", "tests"],
        capture_output=True, text=True, timeout=1200, cwd=root, env={**os.environ, "ATTN_EXPORT_CPU_ISA": isa})
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
