"""Padded batches at the cost of their tokens (csrc/kernels/cuda/key_tile_range.cuh), run by the
SIMT emulator against float64 references: with the preview switch on, the flash forward (with
and without split-KV) and backward skip the key tiles a key-padding mask pads entirely.

The padding patterns cover right and left padding, interior holes (still masked per element),
and a batch row with every key padded (zero output, lse = -inf, zero gradients, never NaN),
under both causal alignments and grouped-query heads.

That the tiles are really skipped is shown by poison: the keys and values outside the first and
last visible key's 128-key-aligned span (so outside the clamped range for every tile size of
the kernels, all dividing 128) are NaN in what the kernels read, while the reference sees clean
values (its masks exclude them anyway). A tile that is loaded, even though every score in it is
then masked, turns the row's output (0 * NaN in P V) and dQ (dS = P * NaN) into NaN. The
control test runs the same poison with the switch off, where the tiles are computed and masked:
there the NaN must show, so the poison test can fail.

Tolerances (cuda_emulator/testing.py): outputs 2 eps, gradients 4 eps of the dtype.
"""
from __future__ import annotations

import pytest
import torch

from cuda_emulator.testing import EMULATOR_MARKS, TOL_GRAD, TOL_OUT
from helpers import assert_parity, ci_sample, reference_attention

pytestmark = EMULATOR_MARKS

from cuda_emulator.build import H200_SMS  # noqa: E402 - what the emulated device reports by default
LK = 300  # keys: not a multiple of any tile
SPAN = 128  # every flash kernel's key tile (32, 64 or 128 keys) divides it


def _padding(batch_rows: int) -> torch.Tensor:
    """[4, LK] bool, True = padded: right padding, left padding, holes between padded ends, all padded."""
    m = torch.zeros(4, LK, dtype=torch.bool)
    m[0, 100:] = True  # right: keys 128.. are whole padded tiles
    m[1, :160] = True  # left: keys ..127 are whole padded tiles
    m[2, :70] = True  # padded ends inside the first/last span, and an interior hole
    m[2, 130:200] = True
    m[2, 260:] = True
    m[3, :] = True  # a batch row with nothing to see
    return m[:batch_rows]


def _poison_keys(padded: torch.Tensor) -> torch.Tensor:
    """[B, LK] bool: the keys outside the SPAN-aligned span of each row's visible keys."""
    poison = torch.ones_like(padded)
    for b, row in enumerate(padded):
        visible = (~row).nonzero().flatten()
        if len(visible):
            lo = int(visible[0]) // SPAN * SPAN
            hi = -(-(int(visible[-1]) + 1) // SPAN) * SPAN
            poison[b, lo:hi] = False
    return poison


def _poisoned(t: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
    """t [B, Hkv, LK, D] with NaN at the poisoned keys of every head."""
    return t.masked_fill(poison[:, None, :, None], float("nan"))


def _run(ops, dtype, *, Lq, H, Hkv, D, masks, mask_dtype=torch.bool):
    """Forward and backward of the emulated kernels on poisoned K/V; the float64 reference on clean ones."""
    padded = masks["key_padding_mask"]
    kpm = padded if mask_dtype == torch.bool else torch.zeros(padded.shape, dtype=mask_dtype).masked_fill(
        padded, float("-inf"))
    B = padded.shape[0]
    q = torch.randn(B, H, Lq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, LK, D, dtype=dtype), torch.randn(B, Hkv, LK, D, dtype=dtype)
    poison = _poison_keys(padded)
    k_bad, v_bad = _poisoned(k, poison), _poisoned(v, poison)
    causal, alignment = masks.get("is_causal", False), int(masks.get("causal_alignment", 0))
    out, lse, _ = ops.forward(q, k_bad, v_bad, None, kpm, causal, None, False, 0.0, alignment)
    grad_out = torch.randn(B, H, Lq, D, dtype=dtype)
    grads = ops.backward(grad_out, None, q, k_bad, v_bad, lse, None, kpm, causal, None, 0.0, alignment)

    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_p = reference_attention(*ref_in, **masks)
    ref_grads = torch.autograd.grad((ref_out * grad_out.double()).sum(), ref_in)
    return dict(out=out, lse=lse, grads=grads, ref_out=ref_out, ref_p=ref_p, ref_grads=ref_grads, padded=padded)


def _check(r, dtype):
    out, lse, grads = r["out"], r["lse"], r["grads"]
    assert not out.isnan().any() and not lse.isnan().any(), "a padded tile was read: NaN reached the output"
    assert all(not g.isnan().any() for g in grads), "a padded tile was read: NaN reached the gradients"
    assert_parity(out, r["ref_out"], TOL_OUT[dtype], "output", scale=1.0)
    hidden = r["ref_p"].sum(-1) == 0  # rows that see no key: zero output, lse = -inf
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()
    for g, w, name in zip(grads, r["ref_grads"], "qkv"):
        assert_parity(g, w, TOL_GRAD[dtype], f"grad {name}", scale=1.0)
    for g in grads[1:]:  # padded keys get exactly zero dK, dV (summed over a group's query heads)
        assert (g.transpose(1, 2)[r["padded"]] == 0).all()


CAUSAL = {
    "none": {},
    "top_left": {"is_causal": True},
    "bottom_right": {"is_causal": True, "causal_alignment": 1},
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", list(CAUSAL))
@pytest.mark.parametrize("sms", [1, H200_SMS], ids=["one-program-per-tile", "split-kv"])
def test_padded_tiles_are_skipped(emu_ops, dtype, causal, sms):
    """Right, left, interior and full padding, forward and backward, grouped-query heads (4 query
    heads per key head); with many SMs the 9 query rows leave the GPU idle, so the forward splits
    the keys (split-KV: checked through the workspace the dispatch asks for)."""
    emu_ops.set_preview(True)
    emu_ops.set_sm_count(sms)
    padded = _padding(4)
    Lq = 9
    probe = torch.zeros(4, 4, Lq, 64, dtype=dtype), torch.zeros(4, 1, LK, 64, dtype=dtype)
    masks = {"key_padding_mask": padded, **CAUSAL[causal]}
    split = emu_ops.forward_workspace_size(probe[0], probe[1], probe[1], masks.get("is_causal", False),
                                           int(masks.get("causal_alignment", 0))) > 0
    assert split == (sms == H200_SMS and causal != "top_left")  # top-left: 9 queries see 9 keys, one tile
    _check(_run(emu_ops, dtype, Lq=Lq, H=4, Hkv=1, D=64, masks=masks), dtype)


# CI: each tile size and each mask kind once (bool at 32, additive at 128).
@pytest.mark.parametrize("mask_dtype, D", ci_sample([(torch.bool, 32), (torch.bool, 128), (torch.float32, 128),
                                                     (torch.float32, 32)], ids=["bool-32", "bool-128", "additive-128",
                                                                                "additive-32"]))
def test_padded_tiles_are_skipped_at_other_tiles(emu_ops, D, mask_dtype):
    """The other key tile sizes (head dim 32: 128-key forward tiles; 128: the backward's column
    split), an additive (-inf) padding mask, many query tiles (a long prompt, 150 queries). One
    head: the skip is per batch row, the same for every head, and grouped-query heads are
    covered above (half the emulation time of two heads, CI). 12 SMs keep the 64-row forward and
    its key tiles (4 x 3 programs fill them, no split; 4 x 2 of 128 rows would not:
    dispatch_policy.h wide_forward_tiles; test_cuda_wide_tiles.py covers those)."""
    emu_ops.set_preview(True)
    emu_ops.set_sm_count(12)
    masks = {"key_padding_mask": _padding(4), "is_causal": True, "causal_alignment": 1}
    probe_q, probe_kv = torch.zeros(4, 1, 150, D).half(), torch.zeros(4, 1, LK, D).half()
    assert emu_ops.forward_block_m(probe_q, probe_kv, probe_kv, True, 1) == 64
    assert emu_ops.forward_workspace_size(probe_q, probe_kv, probe_kv, True, 1) == 0
    _check(_run(emu_ops, torch.float16, Lq=150, H=1, Hkv=1, D=D, masks=masks, mask_dtype=mask_dtype),
           torch.float16)


def test_poison_shows_when_tiles_are_computed(emu_ops):
    """The control: with the preview off the kernels compute and mask the padded tiles, and the
    poison reaches the output and dQ of exactly the rows whose padded tiles hold it."""
    emu_ops.set_preview(False)
    try:
        r = _run(emu_ops, torch.float16, Lq=9, H=2, Hkv=2, D=64, masks={"key_padding_mask": _padding(4)})
    finally:
        emu_ops.set_preview(True)
    poisoned_rows = _poison_keys(r["padded"]).any(-1)
    assert poisoned_rows.tolist() == [True, True, False, True]
    nan_rows = r["out"].isnan().flatten(1).any(-1)
    assert nan_rows.tolist() == poisoned_rows.tolist()
    assert r["grads"][0].isnan().flatten(1).any(-1).tolist() == poisoned_rows.tolist()
