"""What the emulator's test files share: the skip where the kernels cannot be emulated, and the
tolerances of emulated kernels against the float64 reference (a few eps of the dtype: the
emulator runs the kernels' own arithmetic, so only rounding separates them)."""
from __future__ import annotations

import math
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

def runs_generic_kernels(test_name: str, params: dict) -> bool:
    """Whether an emulator test case runs the generic kernels (float32/float64, or a test that
    forces the generic path), which issue no cp.async and are dispatched alike on sm_80 and sm_90:
    test_cuda_emulator.py runs them once, as late-sm90."""
    return "generic" in test_name or params.get("dtype") in (torch.float32, torch.float64)


TOL_OUT = {torch.float64: 1e-12, torch.float32: 8 * EPS[torch.float32], torch.float16: 2 * EPS[torch.float16],
           torch.bfloat16: 2 * EPS[torch.bfloat16]}
TOL_GRAD = {torch.float64: 1e-12, torch.float32: 16 * EPS[torch.float32], torch.float16: 4 * EPS[torch.float16],
            torch.bfloat16: 4 * EPS[torch.bfloat16]}


def reference_lse(q, k, attn_mask=None, key_padding_mask=None, is_causal=False, causal_alignment=0, window=0,
                  softcap=None):
    """log(sum_j exp(s_j)) of each (batch, head, query) row in float64, with the reference's masks
    (reference_attention's conventions); -inf where a row sees no key."""
    q, k = q.double(), k.double()
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    if softcap:
        s = softcap * torch.tanh(s / softcap)

    def additive(m):
        return torch.zeros(m.shape, dtype=torch.float64).masked_fill(m, -math.inf) if m.dtype == torch.bool \
            else m.double()

    if attn_mask is not None:
        s = s + additive(attn_mask)
    if key_padding_mask is not None:
        s = s + additive(key_padding_mask[:, None, None, :])
    if is_causal:
        shift = Lk - Lq if causal_alignment == 1 else 0
        s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).triu(1 + shift), -math.inf)
        if window > 0:
            s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).tril(shift - window), -math.inf)
    return torch.logsumexp(s, dim=-1)
