"""Sliding-window attention at the cost of its window (csrc/kernels/cuda/flash_fwd_kernel.cuh and
flash_bwd_kernel.cuh, preview): the flash forward starts its key-tile loop at the first tile any
row of the query tile can see, the split-KV chunks intersect their range with it, and the flash
backward ends its query-block loop after the last query block whose window reaches the key
block. Run by the SIMT emulator against float64 references (helpers.reference_attention).

That the tiles are really skipped is shown by poison, as in test_cuda_key_tile_skip.py: NaN in
what the kernels read but no row may see, clean values for the reference. A tile that is loaded,
even though every score in it is then masked, turns an output or a gradient into NaN (0 * NaN in
P V; dS = P * (dP - delta) with dP or delta NaN). The cases put the window's edge exactly on a
tile border (head dim 64: 64-key forward tiles, 64-key backward blocks streaming 64-query
blocks), so a tile bound off by one either reads the poison or drops a tile that parity needs:

* keys before every row's window (bottom-right, Lq < Lk: a prefill chunk or a decode step
  under a KV cache): K and V NaN there; the forward and the backward both read them unless
  skipped (the backward's key blocks wholly before every window visit no query block);
* queries after every key's window (top-left, Lq > Lk: rows that see no key): Q and dO NaN
  there; only the backward's query loop reaches them.

The control test runs the first case with the preview off (today's verified route, which
computes and masks every tile): the poison must show there, so the poison tests can fail.
Tolerances (cuda_emulator/testing.py): outputs 2 eps, gradients 4 eps of the dtype.
"""
from __future__ import annotations

import pytest
import torch

from cuda_emulator.testing import EMULATOR_MARKS, TOL_GRAD, TOL_OUT
from cuda_emulator.build import H200_SMS
from helpers import assert_parity, reference_attention

pytestmark = EMULATOR_MARKS

D = 64
TILE = 64  # head dim 64: the forward's key tiles and the backward's key and query blocks
LK = 300  # keys of the bottom-right cases: not a multiple of the tile
FIRST_SEEN = 2 * TILE  # their first row's window starts at key 128: tiles 0 and 1 are before every window


def _run(ops, dtype, q, k, v, kpm, alignment, window):
    """Forward and backward of the emulated kernels on the tensors given."""
    out, lse, _ = ops.forward(q, k, v, None, kpm, True, None, False, 0.0, alignment, window)
    grad_out = torch.randn(out.shape, dtype=dtype)
    grads = ops.backward(grad_out, None, q, k, v, lse, None, kpm, True, None, 0.0, alignment, window)
    return out, lse, grad_out, grads


def _check(got, clean, kpm, alignment, window, dtype, poisoned_rows=None):
    """Parity of the poisoned run `got` (out, lse, grad_out, grads) with the float64 reference on
    the clean tensors; NaN anywhere means a poisoned tile was read. poisoned_rows: query rows
    whose Q and dO were NaN (they see no key: zero output and dQ, lse -inf)."""
    out, lse, grad_out, grads = got
    assert not out.isnan().any() and not lse.isnan().any(), "a tile outside every window was read (output)"
    for g, name in zip(grads, "qkv"):
        assert not g.isnan().any(), f"a tile outside every window was read (grad {name})"
    grad_out = grad_out.clone()
    if poisoned_rows is not None:
        grad_out[:, :, poisoned_rows] = 0  # the reference's rows that see no key: any dO gives zero
    ref_in = [t.double().requires_grad_() for t in clean]
    ref, p = reference_attention(*ref_in, key_padding_mask=kpm, is_causal=True, causal_alignment=alignment,
                                 window=window)
    want = torch.autograd.grad(ref, ref_in, grad_out.double())
    assert_parity(out, ref, TOL_OUT[dtype], f"output, window {window}", scale=1.0)
    hidden = p.sum(-1) == 0
    assert (out[hidden] == 0).all() and (lse[hidden] == -torch.inf).all()
    for g, w, name in zip(grads, want, "qkv"):
        assert_parity(g, w, TOL_GRAD[dtype], f"grad {name}, window {window}", scale=1.0)


# (query heads, key/value heads, queries): a prefill chunk of 40 queries (one query tile; not
# packed: 2 x 40 rows need as many tiles as 2 heads), and a decode step of 4 query heads per
# key/value head (packed into one tile's rows). The window puts the first row's first key at
# FIRST_SEEN: window = Lk - Lq + 0 - FIRST_SEEN + 1 (query 0 sees keys (shift - window, shift]).
SHAPES = {"prefill-chunk": (2, 1, 40), "decode-packed": (4, 1, 1)}


def _keys_before_window(ops, dtype, shape, sms, preview=True):
    """The bottom-right case with K/V NaN before every row's window; batch row 1 also padded up
    to key 200 (inside the window: key_tile_range and the window clamp together)."""
    ops.set_preview(preview)
    ops.set_sm_count(sms)
    H, Hkv, Lq = SHAPES[shape]
    window = LK - Lq - FIRST_SEEN + 1
    q = torch.randn(2, H, Lq, D, dtype=dtype)
    k, v = torch.randn(2, Hkv, LK, D, dtype=dtype), torch.randn(2, Hkv, LK, D, dtype=dtype)
    kpm = torch.zeros(2, LK, dtype=torch.bool)
    kpm[1, :200] = True
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :FIRST_SEEN] = float("nan")
    v_bad[:, :, :FIRST_SEEN] = float("nan")
    return _run(ops, dtype, q, k_bad, v_bad, kpm, 1, window), (q, k, v), kpm, window


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("sms", [1, H200_SMS], ids=["one-program-per-tile", "split-kv"])
def test_keys_before_every_window_are_skipped(emu_ops, shape, sms):
    """Forward (whole and split-KV, unpacked and packed grouped-query rows) and backward skip the
    key tiles before the first row's window: the NaN there never reaches out, lse or a gradient."""
    dtype = torch.float16 if sms == 1 else torch.bfloat16
    torch.manual_seed(len(shape) + sms)
    try:
        H, Hkv, Lq = SHAPES[shape]
        probe_q, probe_k = torch.zeros(2, H, Lq, D, dtype=dtype), torch.zeros(2, Hkv, LK, D, dtype=dtype)
        emu_ops.set_preview(True)
        emu_ops.set_sm_count(sms)
        assert emu_ops.packs_query_heads(probe_q, probe_k, probe_k, True, 1) == (shape == "decode-packed")
        assert (emu_ops.forward_workspace_size(probe_q, probe_k, probe_k, True, 1) > 0) == (sms == H200_SMS)
        got, clean, kpm, window = _keys_before_window(emu_ops, dtype, shape, sms)
        _check(got, clean, kpm, 1, window, dtype)
    finally:
        emu_ops.set_sm_count(H200_SMS)


def test_poison_shows_when_every_tile_is_computed(emu_ops):
    """The control: with the preview off, the verified route computes every key tile and masks the
    window per element; the poison before the window reaches the output and the gradients."""
    try:
        got, _, _, _ = _keys_before_window(emu_ops, torch.float16, "prefill-chunk", 1, preview=False)
    finally:
        emu_ops.set_preview(True)
    out, _, _, grads = got
    assert out.isnan().any() and grads[0].isnan().any()


@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_queries_after_every_window_are_skipped(emu_ops, padded):
    """Top-left, 200 queries over 64 keys (one key block) with a window of 65: query 127 is the
    last that sees a key (key 63), so the backward's query loop ends after block 1 (queries
    64-127). Q and dO of queries 128 on are NaN; those rows see no key (zero output, zero dQ),
    and a query block visited there would put NaN into dK and dV. Padded: batch row 1's keys 40
    on are padded (its rows from 104 on see no key, in blocks the loop still visits)."""
    emu_ops.set_preview(True)
    emu_ops.set_sm_count(1)
    try:
        torch.manual_seed(7 + padded)
        dtype, Lq, Lk, window = torch.float16, 200, TILE, TILE + 1
        q = torch.randn(2, 2, Lq, D, dtype=dtype)
        k, v = torch.randn(2, 1, Lk, D, dtype=dtype), torch.randn(2, 1, Lk, D, dtype=dtype)
        kpm = None
        if padded:
            kpm = torch.zeros(2, Lk, dtype=torch.bool)
            kpm[1, 40:] = True
        rows = slice(2 * TILE, Lq)
        q_bad = q.clone()
        q_bad[:, :, rows] = float("nan")
        out, lse, _ = emu_ops.forward(q_bad, k, v, None, kpm, True, None, False, 0.0, 0, window)
        grad_out = torch.randn(out.shape, dtype=dtype)
        grad_out[:, :, rows] = float("nan")
        grads = emu_ops.backward(grad_out, None, q_bad, k, v, lse, None, kpm, True, None, 0.0, 0, window)
        _check((out, lse, grad_out, grads), (q, k, v), kpm, 0, window, dtype, poisoned_rows=rows)
    finally:
        emu_ops.set_sm_count(H200_SMS)


# Parity where several tiles fall before and after each window, with a left-padded batch row:
# top-left 200 x 200 with a window of 20, its two query heads packed into one key/value head's
# tiles (400 rows: 7 tiles, not 8; tile 6, head 1's queries 184-199, skips key tiles 0-1; key
# block 0 skips query blocks 2-3); tile 3 holds head 0's queries 192-199 and head 1's 0-55, so
# its window starts at the least over both heads' rows; bottom-right 150 queries over 260 keys with a window
# of 48, unpacked (a key/value head per query head): its windows start at key 63 of the
# first query tile (63 + 64 j of tile j) and key block j is last seen by query 64 j, so a tile
# bound one key or one query short drops a tile that parity needs. Those borders are the 64-row
# forward's: 12 SMs keep it (12 programs of 64 rows fill them, no split; the 8 of 128 rows would
# not: dispatch_policy.h wide_forward_tiles); the 128-row blocks have their own tests
# (test_cuda_wide_tiles.py).
@pytest.mark.parametrize("alignment,Lq,Lk,window,Hkv,sms", [(0, 200, 200, 20, 1, 1), (1, 150, 260, 48, 2, 12)],
                         ids=["top_left-packed", "bottom_right"])
def test_windowed_parity_with_skipped_tiles(emu_ops, alignment, Lq, Lk, window, Hkv, sms):
    emu_ops.set_preview(True)
    emu_ops.set_sm_count(sms)
    try:
        torch.manual_seed(alignment + window)
        dtype = torch.bfloat16 if alignment else torch.float16
        q = torch.randn(2, 2, Lq, D, dtype=dtype)
        k, v = torch.randn(2, Hkv, Lk, D, dtype=dtype), torch.randn(2, Hkv, Lk, D, dtype=dtype)
        assert emu_ops.packs_query_heads(q, k, v, True, alignment) == (Hkv == 1)
        assert emu_ops.forward_block_m(q, k, v, True, alignment) == 64
        assert emu_ops.forward_workspace_size(q, k, v, True, alignment) == 0  # one program per tile, no split
        kpm = torch.zeros(2, Lk, dtype=torch.bool)
        kpm[1, :90] = True
        _check(_run(emu_ops, dtype, q, k, v, kpm, alignment, window), (q, k, v), kpm, alignment, window, dtype)
    finally:
        emu_ops.set_sm_count(H200_SMS)
