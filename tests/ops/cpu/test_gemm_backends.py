"""The CPU layer's GEMM seam (csrc/kernels/cpu/gemm_backend.h, attn_export.ops.gemm): every backend
that can run here holds the layer's precision guarantees, and the choice is made, forced and
refused as documented.

The parity checks run once per backend through the `gemm` fixture (a backend that cannot run
here skips with the reason): fp32 forward and gradients against float64 nn.MultiheadAttention
(projections small enough for the micro-kernels and large enough for the library, masks,
fully masked rows, cross attention into halves of one buffer), float64 gradcheck (the
libraries' dgemm), and the attention core's block GEMMs (runtime.h's blas_gemm) against the
float64 definition.
"""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attn_export
from attn_export.ops import gemm as _gemm
from helpers import MASKS, assert_rel_close, check_core, make_pair

pytestmark = pytest.mark.kernels  # the micro-kernels and the BLAS libraries pick code by CPU

FORWARD_REL, GRAD_REL = 2e-6, 2e-5


@pytest.fixture(params=_gemm.BACKENDS)
def gemm(request):
    why = _gemm.available_backends()[request.param]
    if why:
        pytest.skip(f"GEMM backend {request.param} unavailable: {why}")
    before = attn_export.gemm_backend()
    choice = attn_export.set_gemm_backend(request.param)
    yield choice
    attn_export.set_gemm_backend(before.name if before.forced else "auto")


def _layer_parity(embed_dim, heads, batch, seqlen_q, seqlen_k, kind, masks):
    ref, fused = make_pair(embed_dim, heads, batch_first=True)
    ref64 = copy.deepcopy(ref).double()
    make = lambda n: torch.randn(batch, n, embed_dim, requires_grad=True)  # noqa: E731
    query = make(seqlen_q)
    key = query if kind == "self" else make(seqlen_k)
    value = key if kind == "self" else make(seqlen_k)
    inputs = list(dict.fromkeys((query, key, value)))
    out, _ = fused(query, key, value, need_weights=False, **masks)
    exact, _ = ref64(*(t.double() for t in (query, key, value)), need_weights=False, **masks)
    assert_rel_close(out, exact, FORWARD_REL, "output")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs + list(fused.parameters()), grad)
    want = torch.autograd.grad(exact, inputs + list(ref64.parameters()), grad.double())
    for g, w in zip(got, want):
        assert_rel_close(g, w.float(), GRAD_REL, "gradient")


# decode-sized: 3 tokens against a 600 x 200 weight, enough work for two threads, too few rows to
# split: a library call at top level is cut into column parts (runtime_aten.cpp), 600 columns
# into 16-column pieces with a remainder.
@pytest.mark.parametrize("embed_dim,heads,batch,seqlen", [(40, 5, 3, 7), (256, 8, 1, 600), (200, 8, 1, 3)],
                         ids=["microkernel-sized", "library-sized", "decode-sized"])
def test_self_attention_parity(gemm, embed_dim, heads, batch, seqlen):
    _layer_parity(embed_dim, heads, batch, seqlen, seqlen, "self", {})


def test_cross_attention_with_masks_and_fully_masked_rows(gemm):
    batch, seqlen_q, seqlen_k = 3, 5, 9
    padding = torch.zeros(batch, seqlen_k, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, :] = True  # every key of batch element 2: its rows are fully masked (zeros)
    attn_mask = torch.rand(seqlen_q, seqlen_k) < 0.3
    _layer_parity(40, 5, batch, seqlen_q, seqlen_k, "cross", {"key_padding_mask": padding, "attn_mask": attn_mask})


def test_gradcheck_layer_float64(gemm):
    E, H, B, L = 4, 2, 2, 3  # small: gradcheck costs two forwards per input element
    make = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    inputs = (make(B, L, E), make(3 * E, E), make(3 * E), make(E, E), make(E))
    padding = torch.tensor([[False, False, True], [True, True, True]])  # batch 1: fully masked rows

    def fn(x, w_in, b_in, w_out, b_out):
        return attn_export.multi_head_attention(x, x, x, H, w_in, b_in, w_out, b_out, key_padding_mask=padding,
                                                need_weights=False, batch_first=True)[0]

    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("mask", ["none", "causal+padding+float"])
def test_core_block_gemms(gemm, mask):
    # 256 x 256 scores of head dim 64: blocks of >= 64^3 multiply-adds, which go to the GEMM
    # backend rather than the small-block loops (block_gemm.h).
    B, H, L, D = 1, 2, 256, 64
    check_core("cpu", torch.float32, B, H, L, L, D, MASKS[mask](B, H, L, L))


def test_unknown_backend_is_refused_naming_the_choices():
    with pytest.raises(_gemm.GemmBackendError) as info:
        attn_export.set_gemm_backend("mkl")
    message = str(info.value)
    assert "'mkl'" in message and "ATTN_EXPORT_GEMM" in message
    assert all(name in message for name in _gemm.BACKENDS + ("auto",))


def test_unavailable_openblas_is_refused_with_the_fix(monkeypatch):
    before = attn_export.gemm_backend()
    monkeypatch.setattr(_gemm, "_openblas_path", lambda: (None, "the scipy-openblas32 wheel is not installed"))
    with pytest.raises(_gemm.GemmBackendError, match="openblas.*not available.*scipy-openblas32"):
        attn_export.set_gemm_backend("openblas")
    assert attn_export.gemm_backend() == before  # a refused choice changes nothing


def _cpuinfo(key: str) -> str:
    line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(key)), "")
    return line.partition(":")[2]


def test_auto_choice_is_openblas_on_amd_else_pytorchs_blas_with_the_micro_kernels():
    # The rule of attn_export.ops.gemm, checked on this CPU: OpenBLAS on AMD where the wheel is
    # installed (it is in the test extra), PyTorch's BLAS elsewhere.
    before = attn_export.gemm_backend()
    try:
        choice = attn_export.set_gemm_backend("auto")
    finally:
        attn_export.set_gemm_backend(before.name if before.forced else "auto")
    amd = _cpuinfo("vendor_id").strip() == "AuthenticAMD"
    openblas_installed = _gemm.available_backends()["openblas"] == ""
    assert choice.name == ("openblas" if amd and openblas_installed else "aten"), choice
    assert not choice.forced and choice.reason
    flags = " " + _cpuinfo("flags")
    best = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags and " fma" in flags else None
    # ATTN_EXPORT_CPU_ISA (the lowered runs of test_instruction_sets.py) caps the CPU's best.
    limit = os.environ.get("ATTN_EXPORT_CPU_ISA")
    expected_isa = None if limit == "generic" else "avx2" if limit == "avx2" and best == "avx512" else best
    assert choice.microkernel == expected_isa


def test_auto_choice_without_the_openblas_wheel_is_pytorchs_blas_saying_why():
    before = attn_export.gemm_backend()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_gemm, "_openblas_path", lambda: (None, "the scipy-openblas32 wheel is not installed"))
        try:
            choice = attn_export.set_gemm_backend("auto")
        finally:
            mp.undo()
            attn_export.set_gemm_backend(before.name if before.forced else "auto")
    assert choice.name == "aten" and not choice.forced
    if _cpuinfo("vendor_id").strip() == "AuthenticAMD":
        assert "scipy-openblas32" in choice.reason, choice


def test_environment_variable_forces_a_backend(monkeypatch):
    before = attn_export.gemm_backend()
    monkeypatch.setenv("ATTN_EXPORT_GEMM", "aten")
    try:
        choice = _gemm.configure()  # what importing attn_export runs
    finally:
        attn_export.set_gemm_backend(before.name if before.forced else "auto")
    assert (choice.name, choice.forced, choice.microkernel) == ("aten", True, None)  # a forced library runs every product


def test_unknown_environment_value_fails_the_import_clearly():
    env = dict(os.environ, ATTN_EXPORT_GEMM="fastest")
    proc = subprocess.run([sys.executable, "-c", "import attn_export"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "GemmBackendError" in proc.stderr and "aten, openblas, microkernel" in proc.stderr


def test_gemm_rate_line_times_every_backend_against_onnxruntime():
    pytest.importorskip("onnxruntime")
    from benchmarks import gemm as bench_gemm
    from benchmarks.run import _machine_header

    before = attn_export.gemm_backend()
    rates = bench_gemm.run_gemm_rates([bench_gemm.Gemm("tiny", 5, 24, 8)], rounds=1, min_run_time=0.001)
    assert attn_export.gemm_backend() == before  # the benchmark leaves the choice as it found it
    by_impl = {r.implementation: r for r in rates}
    available = [name for name, why in _gemm.available_backends().items() if not why]
    assert set(available) | {bench_gemm.ORT} <= set(by_impl)
    ort = by_impl[bench_gemm.ORT]
    for r in rates:
        assert r.gflops == pytest.approx(2 * 5 * 24 * 8 / (r.median_us * 1e-6) / 1e9)
        if r is not ort:
            assert r.ratio_to_ort == pytest.approx(ort.median_us / r.median_us)
    header = _machine_header()
    model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name"))
    assert model in header and f"GEMM backend: {before.name}" in header
