"""Grouped-query heads packed into the flash forward's tiles (csrc/kernels/cuda/flash_fwd_kernel.cuh,
kPackGqa; dispatch_policy.h pack_gqa), run by the SIMT emulator against float64 references.

With the preview on, a decode step under grouped-query attention (G = H / Hkv query heads per
key/value head, Lq of a few rows) runs one program per key/value head whose tile rows are the
group's G * Lq rows: row R is query R % Lq of head G * kv + R / Lq. Every row must keep its own
query index (causality in both alignments, the window, the attention mask's row), its own head
(the mask's head, out, lse) and its batch row's key padding; rows that see no key give zeros and
lse = -inf. Checked per row against the float64 reference, output and lse, with and without
split-KV (the emulated SM count steers it), at GQA ratios 1 (not packed), 2, 4 and 8, Lq 1..5 and
G * Lq past one 64-row tile.

Tolerances as in test_cuda_split_kv.py: 2 eps of the dtype for the output; the lse is computed in
float32 from the dtype's exact inputs: 2 eps of float16/bfloat16 relative to its magnitude (the
scores are products of the inputs rounded once to float32, the max and log in float32).
"""
from __future__ import annotations

import math

import pytest
import torch

from cuda_emulator.testing import EMULATOR_MARKS, TOL_OUT, reference_lse
from cuda_emulator.build import H200_SMS
from helpers import EPS, assert_parity, padding_mask, reference_attention

pytestmark = EMULATOR_MARKS

TOL = TOL_OUT


def _chunks(ops, q, k, v, causal, alignment):
    """The key chunks the dispatch chose (test_cuda_split_kv.py's reading of the workspace size)."""
    size = ops.forward_workspace_size(q, k, v, causal, alignment)
    rows, Dv = q.shape[0] * q.shape[1] * q.shape[2], v.shape[3]
    for chunks in range(2, 129):
        if sum(-(-chunks * rows * n * 4 // 256) * 256 for n in (Dv, 1)) == size:
            return chunks
    assert size == 0, f"workspace of {size} bytes fits no chunk count"
    return 1


def _run(ops, dtype, B, H, Hkv, Lq, Lk, D, masks, softcap=0.0):
    """The emulated forward and its checks: output and lse per row against float64, dead rows.
    Returns (packed, chunks) as the dispatch chose them."""
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, Lk, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype)
    causal, alignment = masks.get("is_causal", False), int(masks.get("causal_alignment", 0))
    packed = ops.packs_query_heads(q, k, v, causal, alignment)
    chunks = _chunks(ops, q, k, v, causal, alignment)
    out, lse, _ = ops.forward(q, k, v, masks.get("attn_mask"), masks.get("key_padding_mask"), causal, None, False,
                              softcap, alignment, int(masks.get("window", 0)))
    ref, p = reference_attention(q.double(), k.double(), v.double(), softcap=softcap or None, **masks)
    ref_lse = reference_lse(q, k, softcap=softcap or None, **masks)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_parity(out, ref, TOL[dtype], "output", scale=1.0)
    hidden = p.sum(-1) == 0  # rows that see no key: zero output, lse = -inf
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()
    assert torch.equal(torch.isinf(ref_lse), hidden)
    assert_parity(lse[~hidden], ref_lse[~hidden], TOL[dtype], "lse", scale=ref_lse[~hidden].abs().max().item())
    return packed, chunks


# Every GQA ratio x Lq, each dtype on half of them (alternating, so each ratio and each Lq meets both).
DECODE_CASES = [(torch.float16 if (i + j) % 2 == 0 else torch.bfloat16, group, Lq)
                for i, group in enumerate((1, 2, 4, 8)) for j, Lq in enumerate((1, 2, 3, 5))]


@pytest.mark.parametrize("dtype,group,Lq", DECODE_CASES)
def test_packed_decode_matches_reference(preview, dtype, group, Lq):
    """A KV-cache decode step (bottom-right causal, key padding per batch row), no split: 150 keys
    are too few to split. Packed exactly when there are grouped heads (G * Lq <= 40 rows fill one tile)."""
    masks = {"is_causal": True, "causal_alignment": 1, "key_padding_mask": padding_mask(2, 150)}
    packed, chunks = _run(preview, dtype, 2, 2 * group, 2, Lq, 150, 64, masks)
    assert packed == (group > 1) and chunks == 1


def _per_head_additive(B, H, Lq, Lk):
    m = torch.randn(1, H, Lq, Lk)
    m[0, 1, -1, :] = -math.inf  # head 1's last query sees nothing
    return m


PACKED_MASKS = {
    "bool_2d": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(Lq, Lk) < 0.4},
    "additive_per_batch": lambda B, H, Lq, Lk: {"attn_mask": torch.randn(B, 1, Lq, Lk)},
    "additive_per_head": lambda B, H, Lq, Lk: {"attn_mask": _per_head_additive(B, H, Lq, Lk)},
    "bool_per_head_broadcast_query": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(B, H, 1, Lk) < 0.3},
    "half_full": lambda B, H, Lq, Lk: {"attn_mask": torch.randn(B, H, Lq, Lk).half()},
    "key_padding_hides_a_batch_row": lambda B, H, Lq, Lk: {"key_padding_mask": torch.stack(
        [torch.arange(Lk) < 150, torch.ones(Lk, dtype=torch.bool)])},
    "causal_top_left": lambda B, H, Lq, Lk: {"is_causal": True, "causal_alignment": 0},
    "causal_bottom_right_window": lambda B, H, Lq, Lk: {"is_causal": True, "causal_alignment": 1, "window": 100},
    "causal_bottom_right_bool": lambda B, H, Lq, Lk: {"is_causal": True, "causal_alignment": 1,
                                                      "attn_mask": torch.rand(Lq, Lk) < 0.2},
}


@pytest.mark.parametrize("split", [False, True], ids=["one_chunk", "split_kv"])
@pytest.mark.parametrize("mask", list(PACKED_MASKS))
def test_packed_every_mask(preview, mask, split):
    """G = 4, Lq = 3 (a speculative step), 2 batch rows, 2 key/value heads, 300 keys (5 tiles):
    split-KV with the SMs of an H200, none with 2 SMs (the 4 packed programs fill them). The
    masks broadcast over batch, head or query, or name every head: each packed row must read its own."""
    preview.set_sm_count(H200_SMS if split else 2)
    B, H, Lq, Lk = 2, 8, 3, 300
    packed, chunks = _run(preview, torch.float16, B, H, 2, Lq, Lk, 64, PACKED_MASKS[mask](B, H, Lq, Lk))
    assert packed
    if mask == "causal_top_left":
        assert chunks == 1  # the rows see keys 0..2 only: one tile
    else:
        assert (chunks > 1) == split


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_softcap(preview, dtype):
    packed, _ = _run(preview, dtype, 1, 4, 1, 2, 200, 64, {"is_causal": True, "causal_alignment": 1}, softcap=5.0)
    assert packed


@pytest.mark.parametrize("split", [False, True], ids=["one_chunk", "split_kv"])
@pytest.mark.parametrize("group,Lq,alignment,D,packs", [
    (8, 9, 1, 64, True),     # 72 rows: 2 packed tiles (a head's rows straddle them) instead of 8
    (4, 20, 0, 64, True),    # 80 rows, top-left: rows see keys 0..i; 2 tiles instead of 4
    (2, 33, 1, 128, False),  # 66 rows: 2 tiles, as 2 heads x 1 tile: not packed (no fewer tiles)
    (4, 17, 1, 96, True),    # 68 rows at a padded-tile head dim, 2 tiles instead of 4
])
def test_packed_rows_past_one_tile(preview, group, Lq, alignment, D, packs, split):
    """G * Lq past the 64-row tile: a tile holds the rows of several heads, the last one's partly.
    No mask tensor, so that only the causal bounds decide which key tiles get masked (a second
    packed tile's first row is query 4 of head 3 at G = 4, Lq = 20, not query 64)."""
    preview.set_sm_count(H200_SMS if split else 1)
    masks = {"is_causal": True, "causal_alignment": alignment}
    packed, chunks = _run(preview, torch.bfloat16, 1, group, 1, Lq, 300, D, masks)
    assert packed == packs
    if alignment == 1:
        assert (chunks > 1) == split


def test_packing_needs_the_preview(emu_ops):
    """Without the preview the route expands grouped heads (nothing to pack); with it, grouped
    decode packs and plain multi-head attention never does."""
    q, kv = torch.randn(1, 8, 1, 64).half(), torch.randn(1, 2, 100, 64).half()
    try:
        emu_ops.set_preview(False)
        assert not emu_ops.packs_query_heads(q, kv, kv, True, 1)
        emu_ops.set_preview(True)
        assert emu_ops.packs_query_heads(q, kv, kv, True, 1)
        mha = torch.randn(1, 8, 100, 64).half()
        assert not emu_ops.packs_query_heads(q, mha, mha, True, 1)
        prefill = torch.randn(1, 8, 64, 64).half()  # 64 rows per head already fill a tile
        assert not emu_ops.packs_query_heads(prefill, kv, kv, True, 1)
    finally:
        emu_ops.set_preview(True)


def test_packed_backward_recomputation(preview):
    """The backward's forward recomputation packs too; lse and the gradients match the reference."""
    q = torch.randn(1, 4, 2, 64).half()
    k, v = torch.randn(1, 1, 130, 64).half(), torch.randn(1, 1, 130, 64).half()
    masks = {"is_causal": True, "causal_alignment": 1}
    assert preview.packs_query_heads(q, k, v, True, 1)
    out, lse, _ = preview.forward(q, k, v, None, None, True, None, False, 0.0, 1)
    g = torch.randn_like(out)
    grads = preview.backward(g, None, q, k, v, lse, None, None, True, None, 0.0, 1)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*ref_in, **masks)
    want = torch.autograd.grad(ref, ref_in, g.double())
    for got, w, name in zip(grads, want, "qkv"):
        assert_parity(got, w, 4 * EPS[torch.float16], f"grad {name}", scale=1.0)
