"""The sliding window (``window``) in the CUDA kernels (csrc/kernels/cuda), run by the SIMT emulator
against the float64 reference of helpers (causal diagonal by triu, window by tril).

With the preview switch on, the kernels mask the window themselves: the flash kernels (float16 /
bfloat16, forward and backward, tiles that straddle the window's start and tiles wholly before
it), the generic kernels (float32) and split-KV decoding (chunks wholly outside the window).
With the switch off (the default on a GPU), the binding's verified route passes the window and
the causal diagonal as a boolean mask to the verified kernels (csrc/ops/verified_inputs.cpp).
Tolerances: cuda_emulator/testing.py.
"""
from __future__ import annotations

import pytest
import torch

from cuda_emulator.build import H200_SMS  # what the emulated device reports by default
from cuda_emulator.testing import EMULATOR_MARKS, TOL_GRAD, TOL_OUT
from helpers import assert_parity, reference_attention

pytestmark = EMULATOR_MARKS


def run_and_check(ops, dtype, B, H, Hkv, Lq, Lk, D, alignment, window, padded=True):
    """Forward and backward through the emulated kernels against the float64 reference: output,
    zero rows (lse = -inf) where the window holds no key, and the three gradients."""
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, Lk, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype)
    kpm = None
    if padded:
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[-1, : Lk // 3] = True  # the last batch row left-padded
    out, lse, _ = ops.forward(q, k, v, None, kpm, True, None, False, 0.0, alignment, window)
    g = torch.randn_like(out)
    grads = ops.backward(g, None, q, k, v, lse, None, kpm, True, None, 0.0, alignment, window)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, p = reference_attention(*ref_in, key_padding_mask=kpm, is_causal=True, causal_alignment=alignment,
                                 window=window)
    want = torch.autograd.grad(ref, ref_in, g.double())
    assert torch.isfinite(out).all()
    assert_parity(out, ref, TOL_OUT[dtype], f"output, window {window}", scale=1.0)
    hidden = p.sum(-1) == 0
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()
    for got, w, t, name in zip(grads, want, (q, k, v), "qkv"):
        assert got.shape == t.shape and torch.isfinite(got).all(), f"grad {name}"
        assert_parity(got, w, TOL_GRAD[dtype], f"grad {name}, window {window}", scale=1.0)
    return ref, p


# The flash kernels' lengths make the window cross tile borders (head dim 64: 64 x 64 forward
# tiles, 64-query backward blocks): a 70-key window reaches into a key tile from the last query
# of a query tile but not from its first (fp16 bottom-right: the shift of 64 puts that tile at
# queries 0-63 against keys 0-63; bf16 top-left: queries 64-127 against keys 0-63), which only a
# window wider than a tile tells apart; 1 and 5 stay within a tile. The generic kernels stream
# every key row by row (one warp per query row, no key tiles): a few rows and keys reach each of
# their branches, a window wider than every row's keys included, at a tenth of the emulation
# time (CI). Two query heads on one key/value head keep the grouped-query mapping; the second
# batch row carries the padding.
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("dtype,lengths", [(torch.float16, (67, 131)), (torch.bfloat16, (131, 67)),
                                           (torch.float32, (13, 17))], ids=["fp16-flash", "bf16-flash", "f32-generic"])
def test_preview_kernels_mask_the_window(emu_ops, dtype, lengths, alignment):
    """Windows of 1 (the diagonal alone), shorter than a tile, and spanning tiles; grouped-query
    heads; the flash kernels' head dim 64 and the generic kernels."""
    emu_ops.set_preview(True)
    torch.manual_seed(int(dtype.itemsize) * 10 + alignment)
    Lq, Lk = lengths
    # The 70-key window without padding: a key-padding mask makes every tile read the mask per
    # element, which would hide a wrong choice of the tiles that need the window's.
    for window, padded in ((1, True), (5, True), (70, False)):
        run_and_check(emu_ops, dtype, 2, 2, 1, Lq, Lk, 64, alignment, window, padded)


def test_the_reference_window_changes_the_result(emu_ops):
    """The comparisons above can fail: the window's reference differs from plain causal attention."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, L, 16, dtype=torch.float64) for L in (9, 12, 12))
    with_window, _ = reference_attention(q, k, v, is_causal=True, causal_alignment=1, window=3)
    plain, _ = reference_attention(q, k, v, is_causal=True, causal_alignment=1)
    assert (with_window - plain).abs().max() > 1e-2


def test_split_kv_decoding_with_chunks_outside_the_window(emu_ops):
    """One query per head over 1000 keys, cut into chunks (8 emulated SMs): the window of 100 keys
    leaves most chunks without a visible key; their partials must vanish in the combine."""
    emu_ops.set_preview(True)
    emu_ops.set_sm_count(8)
    try:
        torch.manual_seed(6)
        q = torch.randn(1, 2, 1, 64).half()
        k, v = torch.randn(1, 2, 1000, 64).half(), torch.randn(1, 2, 1000, 64).half()
        assert emu_ops.forward_workspace_size(q, k, v, True, 1) > 0  # a split is chosen
        out, lse, _ = emu_ops.forward(q, k, v, None, None, True, None, False, 0.0, 1, 100)
        ref, _ = reference_attention(q.double(), k.double(), v.double(), is_causal=True, causal_alignment=1,
                                     window=100)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_parity(out, ref, TOL_OUT[torch.float16], "split-KV output", scale=1.0)
    finally:
        emu_ops.set_sm_count(H200_SMS)


@pytest.mark.parametrize("alignment,lengths", [(1, (5, 37)), (0, (37, 20)), (1, (20, 20))])
def test_default_route_passes_the_window_as_a_mask(emu_ops, alignment, lengths):
    """The switch off: the window and the causal diagonal become a boolean mask on the verified
    kernels (key/value expanded to every query head); results as the reference's."""
    emu_ops.set_preview(False)
    try:
        torch.manual_seed(7)
        Lq, Lk = lengths
        run_and_check(emu_ops, torch.float16, 2, 4, 2, Lq, Lk, 64, alignment, 4)
    finally:
        emu_ops.set_preview(True)
