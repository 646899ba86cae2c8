"""The Hopper kernels' layout assumptions, checked offline on the CPU (no GPU): CuTe's layout
algebra of every compiled tile (hopper/flash_{fwd,bwd}_sm90_traits.cuh) evaluated by a host
program, tests/ops/cuda/sm90_layouts.cu. What it checks, each a wrong result on the GPU if it failed:

- the accumulators converted in place are the A operand of the register-sourced wgmma that reads
  them (acc_as_operand_a): the forward's P of S, the backward's P^T and dS^T of S^T and dP^T;
- rowcol's (row, column) view: one row per index, columns c and c + 1 adjacent (paired 4-byte
  stores of O, dK, dV and the 8-byte dQ atomics), and for the softmax a quad holding every column
  of its rows once (the two-shuffle row max and sum);
- the transposed shared-memory views (V^T, Q^T, dO^T, K^T, dS^T) address the same elements;
- the backward writes or adds each element once: P^T/dS^T into shared memory, dK/dV (dK^T/dV^T
  swapped), dQ over its column chunks (d256: two);
- the swapped consumer's P^T/dS^T conversion (probabilities_as_operand) has room for every
  accumulator;
- every wgmma operand slice (a warpgroup's rows or columns, a chunk, an MN-major K step) starts on
  a whole swizzle atom, as CuTe's descriptors (base offset 0) need: dQ's K^T and dS, Q^T and dO^T,
  and swapped S^T's Q/dO and dK^T's/dV^T's dS^T/P^T.

Five deliberately broken mappings must be caught, so that the checks are shown able to fail. Needs
nvcc and the CUTLASS headers (as test_cuda_sm90_build.py); ~30-70 s of compilation, hence slow.
"""
from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from test_cuda_build import _nvcc
from test_cuda_sm90_build import _cutlass_include

ROOT = pathlib.Path(__file__).resolve().parents[3]
PROGRAM = pathlib.Path(__file__).resolve().parent / "sm90_layouts.cu"


@pytest.mark.slow
@pytest.mark.exhaustive  # ~4 min of one core to compile; the sm_90a kernels change rarely: make test-all
@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
@pytest.mark.skipif(_cutlass_include() is None,
                    reason="needs the CUTLASS headers: pip install --no-deps nvidia-cutlass==4.2.0.0 (or ATTN_EXPORT_CUTLASS_INCLUDE)")
def test_register_and_shared_memory_layouts_hold(tmp_path):
    binary = tmp_path / "sm90_layouts"
    build = subprocess.run([_nvcc(), "-std=c++17", "--expt-relaxed-constexpr", "-I", str(ROOT / "csrc"), "-I",
                            _cutlass_include(), "-x", "cu", str(PROGRAM), "-o", str(binary)],
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-4000:]
    result = json.loads(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)
    assert result["controls"] == [True] * 5, "a deliberately broken mapping went unnoticed"
    assert result["problems"] == [], "\n".join(result["problems"])
