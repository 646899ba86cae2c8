"""The Hopper (sm_90a) forward on a Hopper GPU: parity with the float64 reference (and, through the
backward, which reads its log-sum-exp, gradients) at every compiled head dim (32, 64, 96, 128, 192,
256: both schedules of the tile table, ping-pong with overlap and serial), fp16 and bf16, every
mask kind, both causal alignments, the window, grouped-query heads (1 and 8 query heads per key/value head), odd lengths and fully masked
rows; each test checks with the profiler that the sm_90a kernel ran, so none passes on the sm80
path by accident.

Runs only where the kernel is dispatched: a compute-capability-9 GPU, an extension built with 9.0a
in TORCH_CUDA_ARCH_LIST, and ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 (read once per
process; scripts/gpu_check.sh runs this file so). Skipped elsewhere, naming what is missing.
Tolerances as in test_cuda.py (helpers.assert_within): at most twice the error of the plain
same-dtype computation.
"""
from __future__ import annotations

import pytest
import torch

import attn_export
from helpers import MASKS, assert_within, check_core, padding_mask, reference_attention
from sm90_gpu import kernels_run, nan_padded

DEVICE = "cuda"
KERNEL = "flash_fwd_sm90_kernel"
HEAD_DIMS = [32, 64, 96, 128, 192, 256]  # hopper/flash_fwd_sm90.h kHeadDims

pytestmark = pytest.mark.cuda


def _kernels_run(fn) -> set[str]:
    return kernels_run(fn, "the sm_90a forward")


def _check(dtype, B, H, Lq, Lk, D, masks, softcap=None):
    ran = _kernels_run(lambda: check_core(DEVICE, dtype, B, H, Lq, Lk, D, masks, softcap=softcap))
    assert any(KERNEL in name for name in ran), f"the sm_90a forward did not run; kernels: {sorted(ran)}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 7, 97, 128, 1025])
def test_matches_reference(dtype, head_dim, causal, seqlen):
    _check(dtype, 2, 3, seqlen, seqlen, head_dim, {"is_causal": causal})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_masks(dtype, head_dim, mask):
    B, H, Lq, Lk = 2, 3, 97, 301
    _check(dtype, B, H, Lq, Lk, head_dim, MASKS[mask](B, H, Lq, Lk, device=DEVICE))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [0, 50])
def test_softcap_and_window(head_dim, softcap, window):
    masks = {"is_causal": True, "window": window} if window else {"is_causal": True}
    _check(torch.bfloat16, 2, 2, 300, 300, head_dim, masks, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(97, 1025), (1025, 97), (1, 4096)])
def test_grouped_query_heads_and_causal_alignment(dtype, head_dim, group, alignment, Lq, Lk):
    """Key/value head h // group read in place by TMA; Lq > Lk bottom-right leaves rows with no key."""
    H = 8
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE)  # noqa: E731
    q, k, v = make(2, H, Lq, head_dim), make(2, H // group, Lk, head_dim), make(2, H // group, Lk, head_dim)
    masks = {"is_causal": True, "causal_alignment": alignment}
    out = {}
    ran = _kernels_run(lambda: out.setdefault("o", attn_export.attention(q, k, v, **masks)))
    assert any(KERNEL in name for name in ran), f"the sm_90a forward did not run; kernels: {sorted(ran)}"
    exact, _ = reference_attention(q, k, v, **masks)
    plain, _ = reference_attention(q, k, v, dtype=dtype, **masks)
    assert torch.isfinite(out["o"]).all()
    assert_within(out["o"], plain, exact, dtype, "output", max(Lq, Lk, head_dim))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fully_masked_rows_give_zero_and_minus_inf_lse(head_dim):
    """Batch row 1 pads every key: zero output; the backward (which reads lse) stays finite."""
    B, H, L = 2, 2, 130
    _kernels_run(lambda: None)  # skips where the sm_90a forward cannot run
    q, k, v = (torch.randn(B, H, L, head_dim, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))
    pad = padding_mask(B, L, device=DEVICE)
    pad[1] = True
    out = attn_export.attention(q, k, v, key_padding_mask=pad)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def test_strides_tma_refuses_fall_back_to_the_sm80_path():
    """A row stride that is not a multiple of 16 bytes: TMA cannot describe it; the sm80 path runs."""
    base = torch.randn(2, 3, 97, 68, dtype=torch.float16, device=DEVICE)
    q = k = v = base[..., :64]  # row stride 68 elements = 136 bytes
    ran = _kernels_run(lambda: attn_export.attention(q, k, v))
    assert not any(KERNEL in name for name in ran), sorted(ran)
    exact, _ = reference_attention(q, k, v)
    plain, _ = reference_attention(q, k, v, dtype=torch.float16)
    assert_within(attn_export.attention(q, k, v), plain, exact, torch.float16, "output", 97)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_past_the_ends_are_zero_filled_not_read(head_dim, layout, causal):
    """q, k, v are views whose next rows hold NaN (the next head's, or token-major strides with the
    head stride below the row stride), with 2 query heads per key/value head: the partial last
    query and key tiles must come zero-filled by TMA (a V row read past the end puts 0 * NaN in O)."""
    dtype, B, H, Lq, Lk = torch.bfloat16, 2, 4, 97, 201
    q = nan_padded(B, H, Lq, head_dim, dtype, layout)
    k, v = (nan_padded(B, H // 2, Lk, head_dim, dtype, layout) for _ in range(2))
    out = {}
    ran = _kernels_run(lambda: out.setdefault("o", attn_export.attention(q, k, v, is_causal=causal)))
    assert any(KERNEL in name for name in ran), f"the sm_90a forward did not run; kernels: {sorted(ran)}"
    exact, _ = reference_attention(q, k, v, is_causal=causal)
    plain, _ = reference_attention(q, k, v, dtype=dtype, is_causal=causal)
    assert_within(out["o"], plain, exact, dtype, "output", max(Lq, Lk, head_dim))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fully_masked_rows_beside_visible_ones(head_dim):
    """Rows that see no key in both consumer warpgroups' halves of a block (3, 64, 96 of 97), beside
    rows that do: those rows are exactly zero with lse = -inf (and so exactly zero dq from the
    backward, which reads it); the other rows' output and lse match the float64 reference."""
    dtype, B, H, Lq, Lk = torch.float16, 2, 2, 97, 160
    q, k, v = (torch.randn(B, H, L, head_dim, dtype=dtype, device=DEVICE, requires_grad=True) for L in (Lq, Lk, Lk))
    mask = torch.rand(Lq, Lk, device=DEVICE) < 0.3
    hidden = [3, 64, 96]
    mask[hidden] = True
    got = {}
    forward = torch.ops.attn_export._attention_forward
    ran = _kernels_run(lambda: got.setdefault("o", forward(q.detach(), k.detach(), v.detach(), mask, None, False, None, False)))
    assert any(KERNEL in name for name in ran), f"the sm_90a forward did not run; kernels: {sorted(ran)}"
    out, lse, _ = got["o"]
    assert torch.equal(out[:, :, hidden], torch.zeros_like(out[:, :, hidden]))
    assert torch.isneginf(lse[:, :, hidden]).all()
    exact, _ = reference_attention(q, k, v, attn_mask=mask)
    plain, _ = reference_attention(q, k, v, attn_mask=mask, dtype=dtype)
    assert_within(out, plain, exact, dtype, "output", max(Lq, Lk, head_dim))
    visible = [i for i in range(Lq) if i not in hidden]
    scores = lambda t: (q.to(t) @ k.to(t).transpose(-1, -2) / head_dim ** 0.5).masked_fill(mask, float("-inf"))  # noqa: E731
    exact_lse, plain_lse = torch.logsumexp(scores(torch.float64), -1), torch.logsumexp(scores(dtype), -1)
    assert_within(lse[:, :, visible], plain_lse[:, :, visible], exact_lse[:, :, visible], dtype, "lse", Lk)
    dq, dk, dv = torch.autograd.grad(attn_export.attention(q, k, v, attn_mask=mask), (q, k, v), torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, :, hidden], torch.zeros_like(dq[:, :, hidden]))
