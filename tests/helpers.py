"""Shared test helpers: references independent of the code under test, tolerances, and the
console script as users run it."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from attn_export import FusedMultiheadAttention

EPS = {
    torch.float64: torch.finfo(torch.float64).eps,
    torch.float32: torch.finfo(torch.float32).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float16: torch.finfo(torch.float16).eps,
}


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| relative to the scale of the expected tensor (its largest magnitude)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual - expected).abs().max() / scale)


def assert_rel_close(actual, expected, rel: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = max_rel_err(actual, expected)
    assert err <= rel, f"{what}: max relative error {err:.3e} > {rel:.1e}"


def make_pair(embed_dim, num_heads, bias=True, batch_first=False, dtype=torch.float32):
    """A stock nn.MultiheadAttention and a fused layer sharing its parameters."""
    ref = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=batch_first, dtype=dtype)
    with torch.no_grad():  # non-zero biases so that bias gradients are exercised
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return ref, FusedMultiheadAttention.from_module(ref)


def reference_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None):
    """Float64 attention written from the definition, with nn.MultiheadAttention's mask
    conventions (bool True = masked out) and zeros for rows with no visible key."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    bias = torch.zeros(B, H, Lq, Lk, dtype=torch.float64)
    if attn_mask is not None:
        m = attn_mask
        if m.dim() == 3:
            m = m.reshape(-1, H, Lq, Lk) if m.shape[0] != 1 else m.unsqueeze(0)
        bias = bias + (torch.where(m, -math.inf, 0.0) if m.dtype == torch.bool else m.double())
    if key_padding_mask is not None:
        m = key_padding_mask[:, None, None, :]
        bias = bias + (torch.where(m, -math.inf, 0.0) if m.dtype == torch.bool else m.double())
    if is_causal:
        bias = bias.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).triu(1), -math.inf)
    s = s + bias
    visible = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~visible, 0.0), dim=-1) * visible
    return p @ v, p


# --------------------------------------------------------------------------------------------
# The console script
# --------------------------------------------------------------------------------------------

SCRIPT = Path(sys.executable).parent / "attn-export"
EXE = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "attn_export.cli"]


def run(*args, cwd=None, env=None, expect=None):
    """`attn-export ARGS` in a subprocess (``env`` is added to the environment)."""
    proc = subprocess.run([*EXE, *map(str, args)], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, **env} if env else None)
    if expect is not None:
        assert proc.returncode == expect, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def invoke(*args):
    """The same command line in-process (click's CliRunner): for the many quick error cases,
    without paying a Python + torch start-up each."""
    from click.testing import CliRunner

    from attn_export.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return _Result(result.exit_code, result.stdout, result.stderr)


def one_line_error(proc, *words):
    """Exit 2 with exactly one `error: ...` line containing every word, and no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    for word in words:
        assert word in errors[0], errors[0]
