"""The sm80 flash forward with 128 query rows a block (csrc/kernels/cuda/flash_fwd_kernel.cuh,
FlashFwdTraits kRowTiles 2: each warp owns two 16-row MMA tiles, and every K/V fragment it reads
from shared memory feeds both), preview only (dispatch_policy.h wide_forward_tiles), run by the
SIMT emulator against float64 references (output and lse, per row).

The dispatch launches it for prefill-shaped work only: not split, not packed, a head-dim tile in
kWideFwdHeadDims (32, 64), and only while batch x heads x ceil(Lq / 128) programs still fill
the SMs; the emulated SM count steers it, and every case asserts the block_m the plan launched
(forward_block_m). Lengths are odd so that the last 128-row block is partial: Lq 130 leaves rows
128 and 129 in warp 0's first row tile and every second row tile of that block past seqlen_q;
Lq 100 leaves warp 3's second row tile (rows 112..127) dead and its first one partly live.

Tolerances (cuda_emulator/testing.py): output 2 eps of the dtype; lse 2 eps relative to its
magnitude (float32 math on the dtype's exact inputs, as test_cuda_pack_gqa.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from cuda_emulator.build import H200_SMS
from cuda_emulator.testing import EMULATOR_MARKS, TOL_OUT, reference_lse
from helpers import assert_parity, reference_attention

pytestmark = EMULATOR_MARKS


def _check(out, lse, q, k, v, dtype, masks, softcap=None, clean=None):
    """out/lse of the emulated forward against float64 on `clean` (q, k, v; default: the inputs)."""
    q, k, v = clean or (q, k, v)
    ref, p = reference_attention(q.double(), k.double(), v.double(), softcap=softcap, **masks)
    ref_lse = reference_lse(q, k, softcap=softcap, **masks)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN: a poisoned or dead row/tile was read"
    assert_parity(out, ref, TOL_OUT[dtype], "output", scale=1.0)
    hidden = p.sum(-1) == 0  # rows that see no key: zero output, lse = -inf
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()
    assert torch.equal(torch.isinf(ref_lse), hidden)
    assert_parity(lse[~hidden], ref_lse[~hidden], TOL_OUT[dtype], "lse", scale=ref_lse[~hidden].abs().max().item())
    return hidden


def _forward(ops, q, k, v, masks, softcap=0.0):
    causal, alignment = masks.get("is_causal", False), int(masks.get("causal_alignment", 0))
    block_m = ops.forward_block_m(q, k, v, causal, alignment)
    out, lse, _ = ops.forward(q, k, v, masks.get("attn_mask"), masks.get("key_padding_mask"), causal, None, False,
                              softcap, alignment, int(masks.get("window", 0)))
    return block_m, out, lse


def _run(ops, dtype, shape, masks, softcap=0.0, sms=1):
    """(B, H, Hkv, Lq, Lk, D) on `sms` emulated SMs: the block_m launched, and the rows that see no key."""
    B, H, Hkv, Lq, Lk, D = shape
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, Lk, D, dtype=dtype), torch.randn(B, Hkv, Lk, D, dtype=dtype)
    ops.set_sm_count(sms)
    block_m, out, lse = _forward(ops, q, k, v, masks, softcap)
    return block_m, _check(out, lse, q, k, v, dtype, masks, softcap or None)


# Each compiled head dim, fp16 and bf16, causal both alignments and not causal.
@pytest.mark.parametrize("D", [32, 64])
@pytest.mark.parametrize("dtype,masks,Lq,Lk", [
    (torch.float16, {"is_causal": True, "causal_alignment": 0}, 130, 130),
    (torch.bfloat16, {"is_causal": True, "causal_alignment": 1}, 130, 197),
    (torch.bfloat16, {}, 257, 70),
], ids=["fp16-causal-top-left", "bf16-causal-bottom-right", "bf16-not-causal-lq257"])
def test_wide_forward_matches_reference(preview, D, dtype, masks, Lq, Lk):
    torch.manual_seed(D + Lq)
    block_m, _ = _run(preview, dtype, (1, 1, 1, Lq, Lk, D), masks)
    assert block_m == 128


def _masked_rows(Lq, Lk):
    """A bool mask that hides some keys, and every key from rows 3 (a first row tile) and 129 (the
    partial block's live tile): those rows give 0 and lse -inf."""
    m = torch.rand(Lq, Lk) < 0.3
    m[3], m[129] = True, True
    return m


def _additive(Lq, Lk):
    m = torch.randn(2, 1, Lq, Lk)
    m[1, 0, 20, :] = -math.inf  # batch row 1's query 20 (warp 0's second row tile) sees nothing
    return m


@pytest.mark.parametrize("name,masks,softcap", [
    ("bool-fully-masked-rows", {"attn_mask": _masked_rows(130, 90)}, 0.0),
    ("additive-per-batch", {"attn_mask": _additive(130, 90)}, 0.0),
    ("softcap-causal", {"is_causal": True}, 5.0),
    ("window-bottom-right", {"is_causal": True, "causal_alignment": 1, "window": 50}, 0.0),
])
def test_wide_forward_masks(preview, name, masks, softcap):
    torch.manual_seed(len(name))
    block_m, hidden = _run(preview, torch.float16, (2, 1, 1, 130, 90, 64), masks, softcap)
    assert block_m == 128
    if name == "bool-fully-masked-rows":
        assert hidden[:, :, [3, 129]].all()


def test_wide_forward_grouped_heads_in_place(preview):
    """4 query heads on 2 key/value heads, Lq 100: not packed (2 x 100 rows take as many 64-row
    tiles packed as not), so the wide kernel reads each group's key/value head in place."""
    torch.manual_seed(7)
    assert not preview.packs_query_heads(torch.zeros(1, 4, 100, 32).half(), torch.zeros(1, 2, 120, 32).half(),
                                         torch.zeros(1, 2, 120, 32).half(), True, 1)
    block_m, _ = _run(preview, torch.bfloat16, (1, 4, 2, 100, 120, 32), {"is_causal": True, "causal_alignment": 1})
    assert block_m == 128


def test_wide_forward_skips_padded_key_tiles(preview):
    """Key padding at both ends of batch row 0, on the wide kernel's 32-key tiles (head dim 64):
    keys 0..63 and 160.. padded, and NaN in K/V there. Only tiles 2..4 may be read; a tile read
    anyway puts NaN into P V (0 * NaN). Batch row 1 is not padded."""
    torch.manual_seed(11)
    B, H, Lq, Lk, D = 2, 1, 130, 200, 64
    q = torch.randn(B, H, Lq, D).half()
    k, v = torch.randn(B, H, Lk, D).half(), torch.randn(B, H, Lk, D).half()
    kpm = torch.zeros(B, Lk, dtype=torch.bool)
    kpm[0, :64], kpm[0, 160:] = True, True
    k_bad, v_bad = k.clone(), v.clone()
    for t in (k_bad, v_bad):
        t[0, :, :64], t[0, :, 160:] = math.nan, math.nan
    preview.set_sm_count(1)
    masks = {"key_padding_mask": kpm}
    block_m, out, lse = _forward(preview, q, k_bad, v_bad, masks)
    assert block_m == 128
    _check(out, lse, q, k_bad, v_bad, torch.float16, masks, clean=(q, k, v))


@pytest.mark.parametrize("case,sms,block_m", [
    ("fills-the-sms", 4, 128),         # 2 heads x 2 blocks of 128 rows = 4 programs on 4 SMs
    ("too-few-programs", 5, 64),       # 4 wide programs < 5 SMs: the 64-row kernel's 6
    ("split-kv", H200_SMS, 64),        # 6 programs on 132 SMs: the keys are split (64-row tiles)
    ("head-dim-96", 1, 64),            # no wide kernel at the 96 tile
    ("head-dim-128", 1, 64),           # nor at 128 (kernel_traits.h kWideFwdHeadDims)
    ("preview-off", 1, 64),
])
def test_which_block_m_runs(emu_ops, case, sms, block_m):
    """The plan's block_m is the kernel launched: both run correctly here (parity), and the choice
    follows the SMs, the split, the compiled head dims and the preview switch."""
    torch.manual_seed(sms)
    emu_ops.set_preview(case != "preview-off")
    try:
        D = {"head-dim-96": 96, "head-dim-128": 128}.get(case, 64)
        got, _ = _run(emu_ops, torch.float16, (1, 2, 2, 130, 300, D), {"is_causal": True, "causal_alignment": 1},
                      sms=sms)
        assert got == block_m
        workspace = emu_ops.forward_workspace_size(torch.zeros(1, 2, 130, D).half(), torch.zeros(1, 2, 300, D).half(),
                                                   torch.zeros(1, 2, 300, D).half(), True, 1)
        assert (workspace > 0) == (case == "split-kv")
    finally:
        emu_ops.set_preview(True)
        emu_ops.set_sm_count(H200_SMS)
