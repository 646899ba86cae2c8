"""The SIMT emulator against deliberate breakage: tiny purpose-written kernels
(tests/ops/cuda/cuda_emulator/breakage.cpp), each with one synchronization bug a first GPU run would find
or its correct twin, run by the emulator in a standalone ThreadSanitizer build (no torch, one
compile of a few seconds, cached by the sources' hash).

A missing __syncthreads between a shared-memory write and another warp's read, or before a
cp.async refill of a buffer others still read, must be reported as a data race under both
cp.async orderings; a read of a cp.async destination before its wait must read the poison of
fresh shared memory under the late ordering. The fixed twins must run clean and right, so a
report cannot come from the emulator itself. The emulator's other checks (launch limits, the
48 KB opt-in, alignment, guard zones, shuffle masks) are exercised by
test_cuda_emulator.py::test_emulator_fails_where_a_gpu_would.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess

import pytest

from cuda_emulator.testing import EMULATOR_MARKS
from cuda_emulator.build import cuda_include_dir

HERE = pathlib.Path(__file__).resolve().parent / "cuda_emulator"
SOURCES = [HERE / "breakage.cpp", HERE / "emulator_runtime.cpp"]
HEADERS = [HERE / "simt_emulator.h", HERE / "guarded_memory.h"]
TSAN_RACE_EXIT = 66  # ThreadSanitizer's exit status when it reported something

pytestmark = EMULATOR_MARKS


@pytest.fixture(scope="module")
def breakage(tmp_path_factory):
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:12]
    cache = pathlib.Path(os.environ.get("ATTN_EXPORT_EMU_BUILD", pathlib.Path.home() / ".cache" / "attn_export_emu"))
    binary = cache / f"breakage_{digest}"
    if not binary.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        cmd = ["c++", "-std=c++20", "-O1", "-g0", "-pthread", "-fsanitize=thread", "-DATTN_EXPORT_SIMT_EMULATOR",
               "-Wno-attributes", f"-I{HERE}", f"-I{cuda_include_dir()}", *map(str, SOURCES), "-o", str(partial)]
        build = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if build.returncode != 0 and "tsan" in build.stderr:
            pytest.skip(f"the compiler has no ThreadSanitizer runtime: {build.stderr.strip()[-300:]}")
        assert build.returncode == 0, build.stderr
        partial.replace(binary)  # complete or absent: a killed build leaves no binary behind

    def run(case: str, order: str) -> subprocess.CompletedProcess:
        # No LD_PRELOAD (the caller's, e.g. make tsan's, is for the torch extension).
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        return subprocess.run([str(binary), case, order], capture_output=True, text=True, timeout=120, env=env)

    return run


ORDERS = ["late", "early"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("kernel,function", [("exchange", "exchange(bool, float*)"),
                                             ("refill", "refill(bool, float const*, float*)")])
def test_a_missing_syncthreads_is_a_reported_race(breakage, kernel, function, order):
    broken = breakage(f"{kernel}_broken", order)
    assert broken.returncode == TSAN_RACE_EXIT, broken.stdout + broken.stderr
    assert "WARNING: ThreadSanitizer: data race" in broken.stderr
    assert f"(anonymous namespace)::{function}" in broken.stderr  # a frame of the race is the kernel

    fixed = breakage(f"{kernel}_fixed", order)
    assert fixed.returncode == 0, fixed.stderr
    assert "ThreadSanitizer" not in fixed.stderr
    assert fixed.stdout.splitlines() == ["result: ok", "error: "]


def test_a_read_before_the_cp_async_wait_reads_poison_under_the_late_ordering(breakage):
    late = breakage("read_before_wait_broken", "late")
    assert late.returncode == 0, late.stderr
    assert late.stdout.startswith("result: wrong in 64 of 64 threads") and "nan" in late.stdout, late.stdout
    # Under the early ordering the copy has landed when it is read: the bug is invisible there,
    # which is why the late ordering is the emulator's default.
    assert breakage("read_before_wait_broken", "early").stdout.startswith("result: ok")
    for order in ORDERS:
        fixed = breakage("read_before_wait_fixed", order)
        assert fixed.returncode == 0 and fixed.stdout.startswith("result: ok"), fixed.stdout + fixed.stderr


def test_an_unknown_case_is_refused(breakage):
    unknown = breakage("no_such_kernel_broken", "late")
    assert unknown.returncode == 2 and "no case 'no_such_kernel_broken'" in unknown.stderr
