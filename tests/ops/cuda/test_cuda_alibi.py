"""ALiBi slopes (``alibi_slopes``) in the CUDA kernels (csrc/kernels/cuda), run by the SIMT emulator
against the float64 reference of helpers: -slope[h] * |i + Lk - Lq - j| added after the scale and
soft-cap, with the masks, whatever the causal alignment (FlashAttention's alibi_slopes).

The flash forward (float16/bfloat16; split-KV and packed grouped-query decode included) and backward,
and the generic kernels (float32) add the bias per element where they apply the masks; the Hopper
kernels decline slopes (the sm80 path takes them). Non-causal cases are the ones that see an
off-by-one in the distance (under causal masking the visible keys' distances are linear in the key,
and a constant per row cancels in the softmax); causal ones see a wrong sign or a wrong head.
Tolerances: cuda_emulator/testing.py.
"""
from __future__ import annotations

import pytest
import torch

from cuda_emulator.build import H200_SMS  # what the emulated device reports by default
from cuda_emulator.testing import EMULATOR_MARKS, TOL_GRAD, TOL_OUT
from helpers import assert_parity, reference_attention

pytestmark = EMULATOR_MARKS

# Distinct per head, small enough that a hundred keys of distance still leave the softmax spread.
SLOPES = [0.08, 0.03, 0.011, 0.004]


def run_and_check(ops, dtype, B, H, Hkv, Lq, Lk, D, *, causal, alignment=0, mask="padding", backward=True):
    """Forward (and backward) through the emulated kernels with slopes, against the float64 reference:
    output, zero rows (lse = -inf) where a row sees no key, and the three gradients."""
    slopes = SLOPES[:H]
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, Lk, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype)
    am = kpm = None
    if mask == "padding":
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[-1, : Lk // 3] = True  # the last batch row left-padded
    elif mask == "bool_attn":
        am = torch.rand(B, H, Lq, Lk) < 0.2
    elif mask == "float_padding":
        kpm = torch.randn(B, Lk, dtype=torch.float32)
        kpm[-1, : Lk // 3] = -torch.inf
    masks = {"attn_mask": am, "key_padding_mask": kpm, "is_causal": causal, "causal_alignment": alignment}
    out, lse, _ = ops.forward(q, k, v, am, kpm, causal, None, False, 0.0, alignment, 0, alibi_slopes=slopes)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, p = reference_attention(*ref_in, alibi_slopes=slopes, **masks)
    plain, _ = reference_attention(*(t.detach() for t in ref_in), **masks)
    assert (ref - plain).abs().max() > 1e-2, "the slopes must change this case's result"
    assert torch.isfinite(out).all()
    assert_parity(out, ref, TOL_OUT[dtype], "output with slopes", scale=1.0)
    hidden = p.sum(-1) == 0
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()
    if not backward:
        return hidden
    g = torch.randn_like(out)
    grads = ops.backward(g, None, q, k, v, lse, am, kpm, causal, None, 0.0, alignment, 0, alibi_slopes=slopes)
    want = torch.autograd.grad(ref, ref_in, g.double())
    for got, w, t, name in zip(grads, want, (q, k, v), "qkv"):
        assert got.shape == t.shape and torch.isfinite(got).all(), f"grad {name}"
        assert_parity(got, w, TOL_GRAD[dtype], f"grad {name} with slopes", scale=1.0)
    return hidden


# Head dim 64: 64 x 64 forward tiles, 64-query backward blocks; lengths across tile borders.
CASES = [
    # Lq < Lk (a cache), not causal: the distance's kink inside the rows; grouped heads in the kernels.
    pytest.param(torch.float16, 37, 131, False, 0, "padding", id="fp16-flash-noncausal-cache"),
    # bottom-right with Lq > Lk: the first 64 rows see no key (zero rows, lse -inf).
    pytest.param(torch.bfloat16, 131, 67, True, 1, "padding", id="bf16-flash-bottom_right-empty_rows"),
    # top-left: the distance still from the bottom-right diagonal (Lq != Lk).
    pytest.param(torch.float16, 67, 80, True, 0, "bool_attn", id="fp16-flash-top_left"),
    pytest.param(torch.float32, 13, 17, False, 0, "float_padding", id="f32-generic-noncausal"),
    pytest.param(torch.float32, 17, 13, True, 1, "padding", id="f32-generic-bottom_right"),
]


@pytest.mark.parametrize("dtype,Lq,Lk,causal,alignment,mask", CASES)
def test_preview_kernels_add_the_slopes(emu_ops, dtype, Lq, Lk, causal, alignment, mask):
    """Four query heads on two key/value heads, each head its own slope."""
    emu_ops.set_preview(True)
    torch.manual_seed(Lq * 100 + Lk)
    hidden = run_and_check(emu_ops, dtype, 2, 4, 2, Lq, Lk, 64, causal=causal, alignment=alignment, mask=mask)
    if Lq > Lk and causal and alignment == 1:
        assert hidden.any()


def test_split_kv_packed_decode_takes_each_rows_head(emu_ops):
    """Two queries per head over 600 keys, 8 query heads on 2 key/value heads packed into one tile and
    cut into chunks (8 emulated SMs): each packed row must take its own head's slope."""
    emu_ops.set_preview(True)
    emu_ops.set_sm_count(8)
    try:
        torch.manual_seed(11)
        H, Hkv, Lq, Lk = 8, 2, 2, 600
        slopes = [0.05 / 2**h for h in range(H)]
        q = torch.randn(1, H, Lq, 64).half()
        k, v = torch.randn(1, Hkv, Lk, 64).half(), torch.randn(1, Hkv, Lk, 64).half()
        assert emu_ops.packs_query_heads(q, k, v, False, 0)
        assert emu_ops.forward_workspace_size(q, k, v, False, 0) > 0  # a split is chosen
        out, lse, _ = emu_ops.forward(q, k, v, None, None, False, None, False, 0.0, 0, 0, alibi_slopes=slopes)
        ref, _ = reference_attention(q.double(), k.double(), v.double(), alibi_slopes=slopes)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_parity(out, ref, TOL_OUT[torch.float16], "packed split-KV output with slopes", scale=1.0)
    finally:
        emu_ops.set_sm_count(H200_SMS)


def test_default_route_keeps_the_slopes(emu_ops):
    """The switch off (the default on a GPU): grouped heads expanded and the bottom-right diagonal
    passed as a mask by the binding; the slopes still index the query heads."""
    emu_ops.set_preview(False)
    try:
        torch.manual_seed(13)
        run_and_check(emu_ops, torch.float16, 2, 4, 2, 5, 37, 64, causal=True, alignment=1)
    finally:
        emu_ops.set_preview(True)
