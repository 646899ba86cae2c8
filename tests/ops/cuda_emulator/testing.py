"""What the emulator's test files share: the skip where the kernels cannot be emulated, and the
tolerances of emulated kernels against the float64 reference (a few eps of the dtype: the
emulator runs the kernels' own arithmetic, so only rounding separates them)."""
from __future__ import annotations

import shutil

import pytest
import torch

from cuda_emulator.build import cuda_include_dir
from helpers import EPS

# The emulator compiles the kernels with the host compiler against the CUDA headers; slow tier
# (make test-fast leaves it out).
EMULATOR_MARKS = [
    pytest.mark.skipif(cuda_include_dir() is None or shutil.which("c++") is None,
                       reason="needs a C++ compiler and the CUDA headers (cuda_fp16.h) to emulate the kernels"),
    pytest.mark.slow,
]

TOL_OUT = {torch.float64: 1e-12, torch.float32: 8 * EPS[torch.float32], torch.float16: 2 * EPS[torch.float16],
           torch.bfloat16: 2 * EPS[torch.bfloat16]}
TOL_GRAD = {torch.float64: 1e-12, torch.float32: 16 * EPS[torch.float32], torch.float16: 4 * EPS[torch.float16],
            torch.bfloat16: 4 * EPS[torch.bfloat16]}
