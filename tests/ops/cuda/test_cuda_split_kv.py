"""Split-KV decoding (csrc/kernels/cuda/split_kv.h) and the preview switch
(csrc/kernels/cuda/dispatch_policy.h), run by the SIMT emulator against float64 references.

Split-KV: with the preview on and fewer query tiles than SMs, the keys are cut into chunks whose
partial results a combine kernel merges. The emulated device's SM count steers the number of
chunks (the workspace the dispatch asks for says how many it chose); each case is checked at
several counts, with grouped-query heads, every mask kind, both causal alignments and rows that
see no key in some chunk or in all of them.

The preview switch off (the default on a GPU): only what was verified on a GPU is dispatched;
grouped-query heads and the bottom-right alignment still give the right results through the
verified kernels (verified_inputs.h).

Tolerances (cuda_emulator/testing.py): float16/bfloat16 inputs exact in their dtype, the
output rounded to it (and the probabilities for the P V product): 2 eps of the dtype. The split
partials are float32, so the combine adds float32 rounding only.
"""
from __future__ import annotations

import pytest
import torch

from cuda_emulator.testing import EMULATOR_MARKS, TOL_OUT
from helpers import EPS, assert_parity, padding_mask, reference_attention

pytestmark = EMULATOR_MARKS

TOL = TOL_OUT


@pytest.fixture
def default(emu_ops):
    emu_ops.set_preview(False)
    yield emu_ops
    emu_ops.set_preview(True)


def _chunks(ops, q, k, v, Dv, causal=False, alignment=0):
    """The number of key chunks the dispatch chose, from the workspace it asks for: chunks x rows
    x (Dv + 1) floats, each part rounded up to 256 bytes (0 = no split)."""
    size = ops.forward_workspace_size(q, k, v, causal, alignment)
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    for chunks in range(2, 129):
        want = sum(-(-chunks * rows * n * 4 // 256) * 256 for n in (Dv, 1))
        if want == size:
            return chunks
    assert size == 0, f"workspace of {size} bytes fits no chunk count"
    return 1


def _forward(ops, dtype, B, H, Hkv, Lq, Lk, D, masks):
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, Lk, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype)
    am, kpm = masks.get("attn_mask"), masks.get("key_padding_mask")
    causal, alignment = masks.get("is_causal", False), int(masks.get("causal_alignment", 0))
    chunks = _chunks(ops, q, k, v, D, causal, alignment)
    out, lse, _ = ops.forward(q, k, v, am, kpm, causal, None, False, 0.0, alignment)
    ref, p = reference_attention(q.double(), k.double(), v.double(), **masks)
    return chunks, out, lse, ref, p


def _check_forward(out, lse, ref, p, dtype):
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_parity(out, ref, TOL[dtype], "output", scale=1.0)
    hidden = p.sum(-1) == 0  # rows that see no key: zero output, lse = -inf
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()


# (SMs, expected chunks) for one query per head, 2 heads, 1000 keys at head dim 64 (16 key tiles
# of 64): about two programs per SM, at least 2 tiles per chunk, no empty chunk.
@pytest.mark.parametrize("sms,chunks", [(2, 1), (3, 3), (4, 4), (8, 8), (132, 8)])
def test_split_count_follows_the_sms(preview, sms, chunks):
    preview.set_sm_count(sms)
    q, kv = torch.randn(1, 2, 1, 64).half(), torch.randn(1, 2, 1000, 64).half()
    assert _chunks(preview, q, kv, kv, 64) == chunks


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sms", [5, 8, 132])
@pytest.mark.parametrize("group", [1, 4])
def test_split_kv_decode_matches_reference(preview, dtype, sms, group):
    """One query per head over a KV cache of 700 keys (not a multiple of the tile)."""
    preview.set_sm_count(sms)
    H = 4
    chunks, out, lse, ref, p = _forward(preview, dtype, 1, H, H // group, 1, 700, 64, {})
    assert chunks > 1
    _check_forward(out, lse, ref, p, dtype)


def _hide_row(mask, row):
    mask[row] = True
    return mask


SPLIT_MASKS = {
    "bool": lambda B, Lq, Lk: {"attn_mask": torch.rand(Lq, Lk) < 0.5},
    "additive": lambda B, Lq, Lk: {"attn_mask": torch.randn(B, 1, Lq, Lk)},
    "key_padding": lambda B, Lq, Lk: {"key_padding_mask": padding_mask(B, Lk)},
    # batch row 1 sees no key at all; row 0 none of the first 400 (whole chunks hidden)
    "padding_hides_chunks": lambda B, Lq, Lk: {"key_padding_mask": torch.stack(
        [torch.arange(Lk) < 400, torch.ones(Lk, dtype=torch.bool)])},
    "causal_bottom_right": lambda B, Lq, Lk: {"is_causal": True, "causal_alignment": 1},
    "causal_top_left": lambda B, Lq, Lk: {"is_causal": True, "causal_alignment": 0},
    "bool_hides_a_row": lambda B, Lq, Lk: {"attn_mask": _hide_row(torch.rand(Lq, Lk) < 0.3, 1)},
}


@pytest.mark.parametrize("mask", list(SPLIT_MASKS))
def test_split_kv_every_mask(preview, mask):
    """3 query rows (a speculative-decoding step), 2 batch rows, grouped heads 4:2, 520 keys."""
    preview.set_sm_count(16)
    B, Lq, Lk = 2, 3, 520
    masks = SPLIT_MASKS[mask](B, Lq, Lk)
    chunks, out, lse, ref, p = _forward(preview, torch.float16, B, 4, 2, Lq, Lk, 64, masks)
    if mask == "causal_top_left":
        assert chunks == 1  # the rows see keys 0..2 only: one tile, nothing to split
    else:
        assert chunks > 1
    _check_forward(out, lse, ref, p, torch.float16)


@pytest.mark.parametrize("D", [128, 96])
def test_split_kv_other_head_dims(preview, D):
    preview.set_sm_count(8)
    chunks, out, lse, ref, p = _forward(preview, torch.bfloat16, 1, 2, 1, 2, 300, D, {"is_causal": True, "causal_alignment": 1})
    assert chunks > 1
    _check_forward(out, lse, ref, p, torch.bfloat16)


def test_split_kv_backward_recomputation(preview):
    """The backward's forward recomputation runs split too; the gradients still match."""
    preview.set_sm_count(8)
    q = torch.randn(1, 2, 1, 64).half()
    k, v = torch.randn(1, 2, 300, 64).half(), torch.randn(1, 2, 300, 64).half()
    assert _chunks(preview, q, k, v, 64) > 1
    out, lse, _ = preview.forward(q, k, v, None, None, False, None, False)
    g = torch.randn_like(out)
    grads = preview.backward(g, None, q, k, v, lse, None, None, False, None)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*ref_in)
    want = torch.autograd.grad(ref, ref_in, g.double())
    for got, w, name in zip(grads, want, "qkv"):
        assert_parity(got, w, 4 * EPS[torch.float16], f"grad {name}", scale=1.0)


# ---- The preview switch off: what a GPU runs by default.

@pytest.mark.parametrize("head_dim,head_dim_v,flash", [
    (32, 32, True), (64, 64, True), (128, 128, True),             # verified at f427ebe
    (96, 96, False), (192, 192, False), (256, 256, False),        # compiled, not yet run on a GPU
    (80, 80, False), (40, 40, False), (64, 128, False),           # padded onto a compiled size
])
def test_default_dispatch_runs_only_verified_flash_head_dims(default, head_dim, head_dim_v, flash):
    q, v = torch.randn(1, 1, 8, head_dim).half(), torch.randn(1, 1, 8, head_dim_v).half()
    assert default.uses_tensor_cores(q, q, v) == flash
    default.set_preview(True)
    assert default.uses_tensor_cores(q, q, v)  # the preview runs them all on tensor cores
    default.set_preview(False)


def test_default_dispatch_never_splits(default):
    default.set_sm_count(132)
    q, kv = torch.randn(1, 2, 1, 64).half(), torch.randn(1, 2, 1000, 64).half()
    assert default.forward_workspace_size(q, kv, kv, False, 0) == 0
    default.set_preview(True)
    assert default.forward_workspace_size(q, kv, kv, False, 0) > 0
    default.set_preview(False)


@pytest.mark.parametrize("causal", [False, True])
def test_default_head_dim_128_backward(default, causal):
    """Head dim 128 without the preview: the backward's verified tiles (4 warps, no column split)."""
    dtype, B, H, Lq, Lk, D = torch.bfloat16, 1, 2, 45, 77, 128
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype) for L in (Lq, Lk, Lk))
    out, lse, _ = default.forward(q, k, v, None, None, causal, None, False)
    g = torch.randn_like(out)
    grads = default.backward(g, None, q, k, v, lse, None, None, causal, None)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*ref_in, is_causal=causal)
    want = torch.autograd.grad(ref, ref_in, g.double())
    assert_parity(out, ref, TOL[dtype], "output", scale=1.0)
    for got, w, name in zip(grads, want, "qkv"):
        assert_parity(got, w, 4 * EPS[dtype], f"grad {name}", scale=1.0)


@pytest.mark.parametrize("group,alignment,Lq,Lk,mask", [
    (2, 1, 5, 37, "none"),          # bottom-right, Lq < Lk: the diagonal as a bool mask
    (4, 1, 37, 5, "bool"),          # Lq > Lk: rows that see no key, merged with a bool mask
    (1, 1, 1, 70, "additive"),      # the decode step: not causal at all
    (4, 0, 20, 33, "padding"),      # grouped heads expanded, top-left
    (2, 1, 20, 33, "additive"),     # the diagonal merged into an additive mask as -inf
])
def test_default_route_gives_the_same_results(default, group, alignment, Lq, Lk, mask):
    """Grouped-query heads and the bottom-right alignment with the switch off: expanded key/value
    and an explicit mask on the verified kernels; outputs and (group-summed) gradients as the reference."""
    dtype, B, H, D = torch.float16, 2, 4, 64
    q, v_shape = torch.randn(B, H, Lq, D, dtype=dtype), (B, H // group, Lk, D)
    k, v = torch.randn(v_shape, dtype=dtype), torch.randn(v_shape, dtype=dtype)
    masks = {"is_causal": True, "causal_alignment": alignment}
    if mask == "bool":
        masks["attn_mask"] = torch.rand(Lq, Lk) < 0.3
    elif mask == "additive":
        masks["attn_mask"] = torch.randn(B, 1, Lq, Lk).half()
    elif mask == "padding":
        masks["key_padding_mask"] = padding_mask(B, Lk)
    am, kpm = masks.get("attn_mask"), masks.get("key_padding_mask")
    out, lse, _ = default.forward(q, k, v, am, kpm, True, None, False, 0.0, alignment)
    g = torch.randn_like(out)
    grads = default.backward(g, None, q, k, v, lse, am, kpm, True, None, 0.0, alignment)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, p = reference_attention(*ref_in, **masks)
    want = torch.autograd.grad(ref, ref_in, g.double(), allow_unused=True)
    assert_parity(out, ref, TOL[dtype], "output", scale=1.0)
    hidden = p.sum(-1) == 0
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()
    for got, w, t, name in zip(grads, want, (q, k, v), "qkv"):
        assert got.shape == t.shape, f"grad {name}"
        assert_parity(got, torch.zeros_like(t, dtype=torch.float64) if w is None else w, 4 * EPS[dtype],
                      f"grad {name}", scale=1.0)
