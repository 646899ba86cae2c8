"""Shared test helpers: references independent of the code under test, tolerances, and the
console script as users run it."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import attn_export
from attn_export import FusedMultiheadAttention

def ci_sample(values, every: int = 2, ids=None) -> list:
    """pytest params of a sweep of which CI (`make test`) runs every `every`-th value, the first
    included, and `make test-all` the rest (marked exhaustive; docs/testing.md, "Tiers"). Order
    the values so that the kept ones still cover every axis. A tuple is one case's parameters."""
    cases = []
    for index, value in enumerate(values):
        marks = () if index % every == 0 else (pytest.mark.exhaustive,)
        args = value if isinstance(value, tuple) else (value,)
        cases.append(pytest.param(*args, marks=marks, id=None if ids is None else ids[index]))
    return cases


EPS = {
    torch.float64: torch.finfo(torch.float64).eps,
    torch.float32: torch.finfo(torch.float32).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float16: torch.finfo(torch.float16).eps,
}


ROUNDING = 2.0  # the floor below, in units of eps * sqrt(n) * scale


def parity_scale(*references) -> float:
    """The configuration's scale: the largest magnitude over reference tensors of one kind (all
    the input gradients of a case together, all its weight gradients together, or all of them)."""
    return max((float(r.detach().abs().max()) for r in references if r.numel()), default=0.0)


def assert_parity(actual, expected, rel: float, what: str = "", *, scale=None, n: int = 1) -> None:
    """The suite's parity rule: passes when

        max |a - e| <= max(rel * max|e|,  ROUNDING * eps * sqrt(n) * S)

    with S = max(max|e|, scale) the configuration's scale (a number, or reference tensors whose
    parity_scale it is; default: e's own), eps that of a's dtype and n the longest reduction.
    Where e has a real scale the first term rules and the bound is rel relative to e's largest
    magnitude. The second is the rounding error any float computation of that configuration
    makes (the reference's own included): a tensor that is zero up to rounding, or a nearly
    cancelling one, is compared at that level, never against its own noise. Takes tensors or
    numpy arrays (ONNX Runtime's outputs)."""
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    a, e = actual.detach().double(), expected.detach().double()
    own = float(e.abs().max()) if e.numel() else 0.0
    config = own if scale is None else max(own, scale if isinstance(scale, (int, float)) else parity_scale(*scale))
    eps = EPS.get(actual.dtype, EPS[torch.float32])
    floor = ROUNDING * eps * math.sqrt(n) * config
    err = float((a - e).abs().max()) if e.numel() else 0.0
    bound = max(rel * own, floor)
    assert err <= bound, (f"{what}: max |error| {err:.3e} > {bound:.3e} (relative {err / max(own, 1e-300):.3e} "
                          f"> {rel:.1e} of max|expected| {own:.3e}; rounding floor {floor:.2e} at scale {config:.3e})")


def slow_path_outputs(model, inputs):
    """model(**inputs) without gradients on PyTorch's original MultiheadAttention path (no fast
    path, which leaves padded positions undefined): every position is a reference."""
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            return model(**inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| relative to the expected tensor's largest magnitude: a measurement to print or
    to show that something differs (> bound); parity assertions go through assert_parity."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual - expected).abs().max() / scale)


def assert_rel_close(actual, expected, rel: float, what: str = "", *, scale=None, n: int = 1) -> None:
    """assert_parity under its older name."""
    assert_parity(actual, expected, rel, what, scale=scale, n=n)


def make_pair(embed_dim, num_heads, bias=True, batch_first=False, dtype=torch.float32, add_bias_kv=False):
    """A stock nn.MultiheadAttention and a fused layer sharing its parameters."""
    ref = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=batch_first, dtype=dtype,
                                add_bias_kv=add_bias_kv)
    with torch.no_grad():  # non-zero biases so that bias gradients are exercised
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return ref, FusedMultiheadAttention.from_module(ref)


def reference_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                        dtype=torch.float64, softcap=None, causal_alignment=0, window=0, alibi_slopes=None):
    """softmax(cap(scale q k^T) + masks) v written from the definition, computed the plain way in
    `dtype` (float64: the exact reference; the inputs' dtype: the plain same-precision
    computation), on the inputs' device, with nn.MultiheadAttention's mask conventions (bool
    True = masked out) and zeros for rows with no visible key, as the fused operator gives.
    cap(x) = softcap * tanh(x / softcap) (transformers' Gemma 2 soft-capping, before the masks)
    when softcap is given and nonzero, else x. k and v may have fewer heads Hkv (dividing H):
    each is repeated for its group of H / Hkv query heads, as SDPA's enable_gqa. is_causal hides
    keys j > i, or j > i + Lk - Lq with causal_alignment=1 (bottom-right); window > 0 (with
    is_causal) also hides keys j <= i + shift - window (transformers' sliding_window_overlay).
    alibi_slopes (one per query head; rounded to float32, as the operator reads them) add
    -m[h] * |i + Lk - Lq - j| with the masks (FlashAttention's alibi_slopes, whatever the alignment)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    scale = 1.0 / math.sqrt(D) if scale is None else scale

    def additive(m):
        return torch.zeros_like(m, dtype=dtype).masked_fill(m, -math.inf) if m.dtype == torch.bool else m.to(dtype)

    bias = torch.zeros(B, H, Lq, Lk, dtype=dtype, device=q.device)
    if attn_mask is not None:
        m = attn_mask
        if m.dim() == 3 and m.shape[0] == B * H != 1:  # nn.MultiheadAttention's [B*H, Lq, Lk]
            m = m.reshape(B, H, Lq, Lk)
        bias = bias + additive(m)  # anything else broadcasts, as in F.scaled_dot_product_attention
    if key_padding_mask is not None:
        bias = bias + additive(key_padding_mask[:, None, None, :])
    if is_causal:
        shift = Lk - Lq if causal_alignment == 1 else 0
        bias = bias.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).triu(1 + shift), -math.inf)
        if window > 0:
            before = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(shift - window)
            bias = bias.masked_fill(before, -math.inf)
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None and len(alibi_slopes):
        m = torch.as_tensor(alibi_slopes, dtype=torch.float32).to(device=q.device, dtype=dtype)
        i = torch.arange(Lq, device=q.device, dtype=dtype)[:, None]
        j = torch.arange(Lk, device=q.device, dtype=dtype)[None, :]
        s = s - m[:, None, None] * (i + (Lk - Lq) - j).abs()
    s = s + bias
    visible = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~visible, 0.0), dim=-1) * visible
    return p @ v, p


# --------------------------------------------------------------------------------------------
# Devices, inputs and masks shared by the operator tests (CPU, CUDA, the CUDA emulator)
# --------------------------------------------------------------------------------------------

def cuda_skip_reason():
    """Why the CUDA variants of a test cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("attn_export::attention", "CUDA"):
        return "attn_export was built without its CUDA kernels; rebuild with ATTN_EXPORT_CUDA=1 (scripts/gpu_check.sh does)"
    return None


def on_cuda(*values):
    """A parameter set that runs on the GPU: marked `cuda`, skipped with a reason without one."""
    reason = cuda_skip_reason()
    return pytest.param(*values, marks=[pytest.mark.cuda, pytest.mark.skipif(reason is not None, reason=reason or "")])


DEVICES = ["cpu", on_cuda("cuda")]


def qkv(batch=2, heads=3, seqlen_q=5, seqlen_k=7, dim=8, dtype=torch.float32, dim_v=None, requires_grad=False,
        device="cpu"):
    """Random q [B, H, Lq, D], k [B, H, Lk, D], v [B, H, Lk, Dv]."""
    dim_v = dim if dim_v is None else dim_v
    make = lambda *s: torch.randn(*s, dtype=dtype, device=device, requires_grad=requires_grad)  # noqa: E731
    return make(batch, heads, seqlen_q, dim), make(batch, heads, seqlen_k, dim), make(batch, heads, seqlen_k, dim_v)


def padding_mask(batch, seqlen_k, dtype=torch.bool, device="cpu"):
    """Key padding: batch element b > 0 loses its last 3b + 1 keys (all of them when fewer);
    bool (True = padded) or additive (-inf) in `dtype`."""
    m = torch.zeros(batch, seqlen_k, dtype=torch.bool, device=device)
    for b in range(1, batch):
        m[b, max(0, seqlen_k - 3 * b - 1):] = True
    return m if dtype == torch.bool else torch.zeros(batch, seqlen_k, dtype=dtype, device=device).masked_fill(m, -math.inf)


MASKS = {
    "none": lambda B, H, Lq, Lk, device="cpu": {},
    "causal": lambda B, H, Lq, Lk, device="cpu": {"is_causal": True},
    "bool_2d": lambda B, H, Lq, Lk, device="cpu": {"attn_mask": torch.rand(Lq, Lk, device=device) < 0.4},
    "float_2d": lambda B, H, Lq, Lk, device="cpu": {"attn_mask": torch.randn(Lq, Lk, device=device)},
    "bool_3d": lambda B, H, Lq, Lk, device="cpu": {"attn_mask": torch.rand(B * H, Lq, Lk, device=device) < 0.4},
    "float_4d_broadcast_heads": lambda B, H, Lq, Lk, device="cpu": {"attn_mask": torch.randn(B, 1, Lq, Lk, device=device)},
    "bool_4d_full": lambda B, H, Lq, Lk, device="cpu": {"attn_mask": torch.rand(B, H, Lq, Lk, device=device) < 0.4},
    "padding_bool": lambda B, H, Lq, Lk, device="cpu": {"key_padding_mask": padding_mask(B, Lk, device=device)},
    "padding_float": lambda B, H, Lq, Lk, device="cpu": {"key_padding_mask": padding_mask(B, Lk, torch.float32, device)},
    "causal+padding+float": lambda B, H, Lq, Lk, device="cpu": {
        "is_causal": True, "key_padding_mask": padding_mask(B, Lk, device=device),
        "attn_mask": torch.randn(Lq, Lk, device=device)},
}


def masks_in(masks, dtype):
    """The same masks with the floating-point ones converted to `dtype`."""
    return {n: (m.to(dtype) if isinstance(m, torch.Tensor) and m.is_floating_point() else m) for n, m in masks.items()}


# --------------------------------------------------------------------------------------------
# Tolerances derived from a plain computation (FlashAttention style; the GPU tests)
# --------------------------------------------------------------------------------------------

HALF_TYPES = (torch.float16, torch.bfloat16)


def scaled_err(actual, expected, scale=None):
    """max |a - e| relative to the configuration's scale: max |e|, or the larger ``scale`` (a number,
    or reference tensors of the same kind whose parity_scale it is) so that a tensor that is zero up
    to rounding is measured against its kind's magnitude, not its own noise; absolute where both
    are zero."""
    actual, expected = actual.detach().double(), expected.detach().double()
    own = float(expected.abs().max()) if expected.numel() else 0.0
    config = own if scale is None else max(own, scale if isinstance(scale, (int, float)) else parity_scale(*scale))
    return float((actual - expected).abs().max()) / (config or 1.0) if expected.numel() else 0.0


def assert_within(fused, plain, exact, dtype, what, n=1, factor=2.0, *, scale=None):
    """Error of `fused` against `exact` at most `factor` x that of `plain`, plus a slack: one eps
    for float16/bfloat16 (whose error is dominated by roundings the plain computation shares),
    eps * sqrt(n) for float32/float64, whose tiny errors come from the order of summation over
    the longest reduction (n terms), which no two implementations share. Both errors are taken
    relative to the same configuration scale (scaled_err's ``scale``)."""
    assert fused.shape == exact.shape, f"{what}: shape {tuple(fused.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(fused).all(), f"{what}: non-finite values"
    slack = EPS[dtype] * (1.0 if dtype in HALF_TYPES else math.sqrt(n))
    err, bound = scaled_err(fused, exact, scale), factor * scaled_err(plain, exact, scale) + slack
    assert err <= bound, f"{what}: error {err:.2e} > bound {bound:.2e} ({factor}x the plain {dtype} computation's + {slack:.1e})"


# The CPU operator computes in float32 throughout and rounds once: fixed bounds relative to
# each tensor's scale against the float64 reference (output, gradients).
CPU_REL = {torch.float32: (2e-6, 5e-6)}


def check_core(device, dtype, B, H, Lq, Lk, D, masks, Dv=None, scale=None, backward=True, softcap=None):
    """attn_export.attention against the float64 reference, forward and backward to q, k, v.
    On the CPU within CPU_REL; on the GPU within 2x the error of the plain same-dtype
    computation (assert_within)."""
    q, k, v = qkv(B, H, Lq, Lk, D, dtype, Dv, requires_grad=True, device=device)
    out = attn_export.attention(q, k, v, scale=scale, softcap=softcap, **masks)
    exact, _ = reference_attention(q, k, v, scale=scale, softcap=softcap, **masks)
    assert out.dtype == dtype and out.device == q.device
    assert out.shape == (B, H, Lq, D if Dv is None else Dv)
    n = max(Lq, Lk, D)
    plain = None if device == "cpu" else reference_attention(q, k, v, scale=scale, dtype=dtype, softcap=softcap,
                                                             **masks)[0]
    if plain is None:
        assert_rel_close(out, exact, CPU_REL[dtype][0], "output")
    else:
        assert_within(out, plain, exact, dtype, "output", n)
    if not backward:
        return
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_grads = [None] * 3 if plain is None else torch.autograd.grad(plain, (q, k, v), grad)
    for g, p, w, name in zip(got, plain_grads, want, "qkv"):
        assert g.dtype == dtype
        if p is None:
            assert_rel_close(g, w, CPU_REL[dtype][1], f"grad {name}", scale=want, n=n)
        else:
            assert_within(g, p, w, dtype, f"grad {name}", n, scale=want)


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


class MaskedSelfAttention(torch.nn.Module):
    """``nn.MultiheadAttention`` self-attention (batch first, no weights returned) with its
    ``attn_mask`` as the second input: the models of the export tests that pass masks of their own."""

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)

    def forward(self, x, mask):
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


def dims(model, name):
    """The dims of a graph input or output of an ONNX model: a symbol (str) or a size per axis."""
    for v in list(model.graph.input) + list(model.graph.output):
        if v.name == name:
            return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    raise KeyError(name)



def nodes_within(graph):
    """Every node of an ONNX ``graph`` and of the subgraphs its nodes hold (If branches), depth first."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.HasField("g"):
                yield from nodes_within(a.g)
