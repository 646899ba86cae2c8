"""The CPU layer's own projection kernel (csrc/kernels/cpu/linear_kernel.cpp) against float64.

On CPUs with AVX-512 or AVX2+FMA float32 projections of up to 2^25 multiply-adds (behind OpenBLAS
2^23, behind MKL on AMD CPUs with AVX2 2^31: attn_export_linear_kernel_max_work_log2) run on it,
with the token rows or the weight's column panels split across threads (whichever each thread's
packing repeats less); everything else goes to the GEMM library in force
(tests/ops/cpu/test_gemm_backends.py). The shapes below cover its row tails (1-13 rows per tile), narrow last
column panels (3E not a multiple of 32), the column split, the dot-product path of up to 16
token rows (with an embed dim, 22, that leaves a tail of k past the last whole vector and of
columns past the last block of three), cross attention writing into
halves of one buffer, no bias, one and two threads, and the hand-over to BLAS.
"""
import copy

import pytest
import torch

import attn_export
from attn_export.ops import gemm as _gemm
from helpers import assert_rel_close, make_pair

pytestmark = pytest.mark.kernels  # the projections' micro-kernels, per instruction set

REL = 2e-6


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _check(embed_dim, heads, batch, seqlen_q, seqlen_k, kind, bias=True, batch_first=True):
    torch.manual_seed(embed_dim * 1000 + batch * 10 + seqlen_q)
    ref, fused = make_pair(embed_dim, heads, bias=bias, batch_first=batch_first)
    ref64 = copy.deepcopy(ref).double()

    def make(length):
        return torch.randn((batch, length, embed_dim) if batch_first else (length, batch, embed_dim))

    query = make(seqlen_q)
    key = query if kind == "self" else make(seqlen_k)
    value = key if kind in ("self", "shared_kv") else make(seqlen_k)
    out, _ = fused(query, key, value, need_weights=False)
    expected, _ = ref64(query.double(), key.double(), value.double(), need_weights=False)
    assert_rel_close(out, expected, REL, f"E={embed_dim} B={batch} Lq={seqlen_q} Lk={seqlen_k} {kind}")


@pytest.mark.parametrize(
    "embed_dim,heads",
    [(8, 2), (22, 2), (24, 3), (40, 5), (96, 4), (136, 8)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("batch,seqlen", [(1, 1), (1, 3), (3, 4), (1, 13), (8, 16), (2, 37)])
def test_self_attention_against_float64(threads, embed_dim, heads, batch, seqlen):
    _check(embed_dim, heads, batch, seqlen, seqlen, "self")


@pytest.mark.parametrize("kind", ["shared_kv", "cross"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_cross_attention_against_float64(threads, kind, batch_first):
    _check(40, 5, 3, 7, 11, kind, batch_first=batch_first)


@pytest.mark.parametrize("batch,seqlen", [(8, 1), (2, 50)])
def test_without_bias(threads, batch, seqlen):
    _check(96, 4, batch, seqlen, seqlen, "self", bias=False)


def _max_work_log2():
    import ctypes
    from attn_export import _C
    return ctypes.CDLL(_C.__file__).attn_export_linear_kernel_max_work_log2()


def test_large_products_agree(threads):
    # 640 tokens x 256 x 768 = 1.3e8 multiply-adds: BLAS's input projection where the kernel's
    # limit is 2^25, the kernel's where it is 2^31.
    _check(256, 8, 1, 640, 640, "self")


def test_products_above_the_kernels_limit_go_to_blas():
    if attn_export.gemm_backend().microkernel is None:
        pytest.skip(f"the projection kernel is off: {attn_export.gemm_backend()}")
    embed = 512
    _, fused = make_pair(embed, 8, batch_first=True)
    # PyTorch's BLAS behind the micro-kernels, whatever the automatic choice: the profiler sees
    # its calls (OpenBLAS's it does not). The limit is the one for that library.
    before = attn_export.gemm_backend()
    lib = _gemm._lib()
    assert lib.attn_export_gemm_set(_gemm.BACKENDS.index("aten"), 1) == 0
    try:
        tokens = 2 ** _max_work_log2() // (3 * embed * embed) + 1  # the input projection just above it
        assert "aten::addmm" in _blas_calls(fused, torch.randn(1, tokens, embed))
        # One token fewer stays on the kernel, which calls no BLAS for it (the output
        # projection, a third of the input one, neither).
        assert _blas_calls(fused, torch.randn(1, tokens - 1, embed)) == []
    finally:
        attn_export.set_gemm_backend(before.name if before.forced else "auto")


def _blas_calls(layer, x):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(x, x, x, need_weights=False)
    return [e.key for e in prof.key_averages() if e.key in ("aten::addmm", "aten::mm")]


def test_small_projections_do_not_call_blas():
    if attn_export.gemm_backend().microkernel is None:
        pytest.skip(f"the projection kernel is off: {attn_export.gemm_backend()}")
    _, fused = make_pair(128, 4, batch_first=True)
    x = torch.randn(8, 16, 128)
    assert _blas_calls(fused, x) == []
    # Forced, PyTorch's BLAS runs them: what makes this check able to fail.
    before = attn_export.gemm_backend()
    try:
        attn_export.set_gemm_backend("aten")
        assert _blas_calls(fused, x) != []
    finally:
        attn_export.set_gemm_backend(before.name if before.forced else "auto")
