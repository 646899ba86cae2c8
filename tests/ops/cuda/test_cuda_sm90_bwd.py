"""The Hopper (sm_90a) backward on a Hopper GPU: gradients of q, k, v against the float64 reference
and against SDPA's own same-dtype gradients at head dims 32, 64, 96, 128, 192 and 256 (the last
two on the swapped code path), fp16 and bf16, every mask kind, both causal alignments, the window,
soft-cap, grouped-query heads (1, 4 and 8 query heads per key/value head), odd lengths and fully
masked rows; the deterministic mode reproducible bit for bit. Each test checks with the profiler
that the sm_90a backward kernel ran, so none passes on the sm80 path by accident.

Runs only where the kernel is dispatched: a compute-capability-9 GPU, an extension built with 9.0a,
and ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 (read once per process; scripts/gpu_check.sh's
sm90 step runs this file so). Skipped elsewhere, naming what is missing. Tolerances as in
test_cuda.py (helpers.assert_within): at most twice the error of the plain same-dtype computation.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attn_export
from helpers import MASKS, assert_within, check_core, padding_mask, reference_attention
from sm90_gpu import BF16, DEVICE, F16, HEAD_DIMS, assert_ran, over_masks, over_shapes, kernels_run, nan_padded, padded_batch_mask

KERNEL = "flash_bwd_sm90_kernel"

pytestmark = pytest.mark.cuda

# The quick tier (-m sm90_quick; tests/conftest.py marks these): one case per code path, head dims
# and dtypes alternating (the forward file's the other way round), every test function at least
# once (tests/ops/cuda/test_cuda_sm90_quick.py); the mask kinds the forward file's quick cases leave out.
# Each entry: (test, parameters picking exactly one case).
SM90_QUICK = [
    *(("test_gradients_match_reference", dict(dtype=t, head_dim=d, causal=c, seqlen=n)) for t, d, c, n in [
        (BF16, 32, True, 1025), (F16, 64, False, 1), (BF16, 96, True, 97), (F16, 128, False, 1025),
        (BF16, 192, True, 1025), (F16, 256, True, 1025)]),
    *(("test_masks", dict(dtype=t, head_dim=d, mask=m)) for t, d, m in [
        (BF16, 32, "bool_3d"), (F16, 64, "causal"), (BF16, 128, "float_2d"), (F16, 192, "none"),
        (BF16, 256, "padding_float")]),
    ("test_softcap_and_window", dict(head_dim=192, softcap=None, window=50)),
    ("test_softcap_and_window", dict(head_dim=64, softcap=5.0, window=0)),
    *(("test_grouped_query_heads_and_causal_alignment", dict(dtype=t, head_dim=d, group=g, alignment=a, Lq=q, Lk=k))
      for t, d, g, a, q, k in [(F16, 128, 4, 0, 97, 1025), (BF16, 256, 8, 1, 1025, 97), (BF16, 64, 1, 1, 1, 4096)]),
    ("test_fully_masked_rows_give_zero_gradients", dict(head_dim=192)),
    ("test_deterministic_mode_is_reproducible_bit_for_bit", dict(head_dim=128, causal=True)),
    ("test_deterministic_mode_is_reproducible_bit_for_bit", dict(head_dim=256, causal=False)),
    ("test_rows_past_the_ends_are_zero_filled_not_read", dict(head_dim=128, layout="bhld", causal=True)),
    ("test_rows_past_the_ends_are_zero_filled_not_read", dict(head_dim=192, layout="blhd", causal=False)),
    ("test_deterministic_mode_grouped_heads_and_unequal_lengths", dict(head_dim=64, alignment=0, Lq=1025, Lk=2049)),
    ("test_deterministic_mode_grouped_heads_and_unequal_lengths", dict(head_dim=192, alignment=1, Lq=2049, Lk=1025)),
    ("test_layer_operator_uses_it_and_a_weights_gradient_falls_back", {}),
    ("test_padded_key_blocks", dict(head_dim=128, group=1, deterministic=False)),
    ("test_padded_key_blocks", dict(head_dim=256, group=4, deterministic=True)),
    ("test_padded_key_blocks_causal_deterministic", dict(head_dim=96, alignment=1, group=4)),
    ("test_window_keys_before_every_window_are_not_read", dict(head_dim=128, deterministic=True)),
    ("test_window_queries_after_every_window_are_not_read", dict(head_dim=256, deterministic=False)),
    ("test_window_deterministic_mode_is_reproducible_bit_for_bit", dict(head_dim=64, alignment=1, Lq=1025, Lk=2049)),
]


def _kernels_run(fn) -> set[str]:
    return kernels_run(fn, "the sm_90a backward")


def _assert_ran(ran: set[str]) -> None:
    assert_ran(ran, KERNEL, "the sm_90a backward")


def _check(dtype, B, H, Lq, Lk, D, masks, softcap=None):
    _assert_ran(_kernels_run(lambda: check_core(DEVICE, dtype, B, H, Lq, Lk, D, masks, softcap=softcap)))


@over_shapes
def test_gradients_match_reference(dtype, head_dim, causal, seqlen):
    _check(dtype, 2, 3, seqlen, seqlen, head_dim, {"is_causal": causal})


@over_masks
def test_masks(dtype, head_dim, mask):
    B, H, Lq, Lk = 2, 3, 97, 301
    _check(dtype, B, H, Lq, Lk, head_dim, MASKS[mask](B, H, Lq, Lk, device=DEVICE))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [0, 50])
def test_softcap_and_window(head_dim, softcap, window):
    masks = {"is_causal": True, "window": window} if window else {"is_causal": True}
    _check(torch.bfloat16, 2, 2, 300, 300, head_dim, masks, softcap=softcap)


def _sdpa_grads(q, k, v, grad, group, alignment):
    """SDPA's gradients in the inputs' dtype (its own kernels): the second reference. SDPA gives
    NaN for a row that sees no key (bottom-right with Lq > Lk), the operator zeros: SDPA runs on
    the rows that see a key, and the others' dQ is zero, as in the exact gradient."""
    Lq, Lk = q.shape[2], k.shape[2]
    shift = Lk - Lq if alignment == 1 else 0
    allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril(shift)  # SDPA: True = attend
    rows = allowed.any(-1)
    q_rows = q.detach()[:, :, rows].requires_grad_()
    k, v = (t.detach().requires_grad_() for t in (k, v))
    out = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=allowed[rows], enable_gqa=group > 1)
    dq_rows, dk, dv = torch.autograd.grad(out, (q_rows, k, v), grad[:, :, rows])
    dq = torch.zeros_like(q)
    dq[:, :, rows] = dq_rows
    return dq, dk, dv


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(97, 1025), (1025, 97), (1, 4096)])
def test_grouped_query_heads_and_causal_alignment(dtype, head_dim, group, alignment, Lq, Lk):
    """dK/dV summed over each group in registers; gradients against float64 and against SDPA."""
    H = 8
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE, requires_grad=True)  # noqa: E731
    q, k, v = make(2, H, Lq, head_dim), make(2, H // group, Lk, head_dim), make(2, H // group, Lk, head_dim)
    masks = {"is_causal": True, "causal_alignment": alignment}
    out = attn_export.attention(q, k, v, **masks)
    grad = torch.randn_like(out)
    got = {}
    _assert_ran(_kernels_run(lambda: got.setdefault("g", torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))))
    exact, _ = reference_attention(q, k, v, **masks)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_out, _ = reference_attention(q, k, v, dtype=dtype, **masks)
    plain = torch.autograd.grad(plain_out, (q, k, v), grad)
    sdpa = _sdpa_grads(q, k, v, grad, group, alignment)
    n = max(Lq, Lk, head_dim)
    for g, p, s, w, name in zip(got["g"], plain, sdpa, want, "qkv"):
        assert_within(g, p, w, dtype, f"grad {name} (plain reference)", n, scale=want)
        assert_within(g, s, w, dtype, f"grad {name} (SDPA)", n, scale=want)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fully_masked_rows_give_zero_gradients(head_dim):
    """Batch row 1 pads every key: its gradients are exactly zero, the others finite."""
    B, H, L = 2, 2, 130
    q, k, v = (torch.randn(B, H, L, head_dim, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))
    pad = padding_mask(B, L, device=DEVICE)
    pad[1] = True
    out = attn_export.attention(q, k, v, key_padding_mask=pad)
    grads = {}
    _assert_ran(_kernels_run(lambda: grads.setdefault("g", torch.autograd.grad(out.sum(), (q, k, v)))))
    for g in grads["g"]:
        assert torch.isfinite(g).all()
        assert torch.equal(g[1], torch.zeros_like(g[1]))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_mode_is_reproducible_bit_for_bit(head_dim, causal):
    """torch.use_deterministic_algorithms(True): dQ in key-block order, no atomics; two runs equal."""
    q, k, v = (torch.randn(2, 8, 2049, head_dim, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(2, 8, 2049, head_dim, dtype=torch.bfloat16, device=DEVICE)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(3):
            out = attn_export.attention(q, k, v, is_causal=causal)
            _assert_ran(_kernels_run(lambda: runs.append(torch.autograd.grad(out, (q, k, v), grad))))
    finally:
        torch.use_deterministic_algorithms(previous)
    for later in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], later))
    exact, _ = reference_attention(q, k, v, is_causal=causal)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_out, _ = reference_attention(q, k, v, dtype=torch.bfloat16, is_causal=causal)
    plain = torch.autograd.grad(plain_out, (q, k, v), grad)
    for g, p, w, name in zip(runs[0], plain, want, "qkv"):
        assert_within(g, p, w, torch.bfloat16, f"grad {name}", 2049, scale=want)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("causal", [False, True])
def test_rows_past_the_ends_are_zero_filled_not_read(head_dim, layout, causal):
    """q, k, v and dO are views whose next rows hold NaN (the next head's, or token-major strides),
    with 2 query heads per key/value head: the partial last query block (Q, dO) and key block (K,
    V) must come zero-filled by TMA. A padding row read instead gives NaN scores and dP there, and
    P (0) times NaN puts NaN into dK, dV and dQ."""
    dtype, B, H, Lq, Lk = torch.bfloat16, 2, 4, 97, 201
    q = nan_padded(B, H, Lq, head_dim, dtype, layout).requires_grad_()
    k, v = (nan_padded(B, H // 2, Lk, head_dim, dtype, layout).requires_grad_() for _ in range(2))
    grad = nan_padded(B, H, Lq, head_dim, dtype, layout)
    out = attn_export.attention(q, k, v, is_causal=causal)
    got = {}
    _assert_ran(_kernels_run(lambda: got.setdefault("g", torch.autograd.grad(out, (q, k, v), grad))))
    exact, _ = reference_attention(q, k, v, is_causal=causal)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_out, _ = reference_attention(q, k, v, dtype=dtype, is_causal=causal)
    plain = torch.autograd.grad(plain_out, (q, k, v), grad)
    for g, p, w, name in zip(got["g"], plain, want, "qkv"):
        assert_within(g, p, w, dtype, f"grad {name}", max(Lq, Lk, head_dim), scale=want)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(1025, 2049), (2049, 1025)])
def test_deterministic_mode_grouped_heads_and_unequal_lengths(head_dim, alignment, Lq, Lk):
    """The key-block order under causal shifts of both signs (key blocks whose first query block is
    past the first, or the last and fully masked one) and a group of 4 query heads per key/value
    head (one order slot per query head): reproducible bit for bit, no deadlock, and right."""
    dtype, B, H, Hk = torch.bfloat16, 2, 8, 2
    q = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, Hk, Lk, head_dim, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE)
    masks = {"is_causal": True, "causal_alignment": alignment}
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            out = attn_export.attention(q, k, v, **masks)
            _assert_ran(_kernels_run(lambda: runs.append(torch.autograd.grad(out, (q, k, v), grad))))
    finally:
        torch.use_deterministic_algorithms(previous)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    exact, _ = reference_attention(q, k, v, **masks)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_out, _ = reference_attention(q, k, v, dtype=dtype, **masks)
    plain = torch.autograd.grad(plain_out, (q, k, v), grad)
    for g, p, w, name in zip(runs[0], plain, want, "qkv"):
        assert_within(g, p, w, dtype, f"grad {name}", max(Lq, Lk), scale=want)


def test_layer_operator_uses_it_and_a_weights_gradient_falls_back():
    """multi_head_attention's autograd runs the sm_90a backward (head dim 64); with the returned
    weights in the loss (dP += dW) the sm80 backward, which computes that term, runs instead."""
    E, H = 256, 4
    layer = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float16, device=DEVICE)
    x = torch.randn(2, 97, E, dtype=torch.float16, device=DEVICE, requires_grad=True)
    args = (x, x, x, H, layer.in_proj_weight, layer.in_proj_bias, layer.out_proj.weight, layer.out_proj.bias)
    out, _ = attn_export.multi_head_attention(*args, need_weights=False, batch_first=True)
    _assert_ran(_kernels_run(lambda: torch.autograd.grad(out.sum(), x)))
    out, weights = attn_export.multi_head_attention(*args, need_weights=True, average_attn_weights=False,
                                                    batch_first=True)
    ran = _kernels_run(lambda: torch.autograd.grad(out.sum() + weights.sum(), x))
    assert not any(KERNEL in name for name in ran), sorted(ran)


def _sm90_grads(q, k, v, grad, masks, deterministic, runs=1):
    """dQ, dK, dV of `runs` backward passes with deterministic algorithms on or off, each checked
    to have run the sm_90a backward."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        got = []
        for _ in range(runs):
            out = attn_export.attention(q, k, v, **masks)
            _assert_ran(_kernels_run(lambda: got.append(torch.autograd.grad(out, (q, k, v), grad))))
    finally:
        torch.use_deterministic_algorithms(previous)
    return got


def _assert_grads_match(got, inputs, grad, masks, dtype, n):
    """Gradients against float64 and the plain same-dtype computation on `inputs`."""
    q, k, v = (t.detach().requires_grad_() for t in inputs)
    exact, _ = reference_attention(q, k, v, **masks)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_out, _ = reference_attention(q, k, v, dtype=dtype, **masks)
    plain = torch.autograd.grad(plain_out, (q, k, v), grad)
    for g, p, w, name in zip(got, plain, want, "qkv"):
        assert_within(g, p, w, dtype, f"grad {name}", n, scale=want)


def _assert_padded_grads(q, k, v, grad, masks, deterministic):
    """bfloat16 gradients against the references; the padded keys' dK and dV exactly zero."""
    got = _sm90_grads(q, k, v, grad, masks, deterministic)[0]
    _assert_grads_match(got, (q, k, v), grad, masks, torch.bfloat16, k.shape[2])
    pad = masks["key_padding_mask"]
    padded = pad[:, None, :, None].expand_as(got[1])
    for g in got[1:]:
        assert torch.equal(g[padded], torch.zeros_like(g[padded]))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("deterministic", [False, True])
def test_padded_key_blocks(head_dim, group, deterministic):
    """Right, left and full padding and interior holes (sm90_gpu.padded_batch_mask), the padded key
    blocks skipped (skip_padded_key_block: dK = dV = 0, no query block loaded); in deterministic
    mode a skipped block still passes on its dQ turns (a lost turn would hang the blocks after it).
    Gradients against float64; the padded keys' dK and dV exactly zero."""
    B, H, Lq, Lk = 5, 4, 300, 1000
    pad = padded_batch_mask(B, Lk, DEVICE)
    make = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)  # noqa: E731
    q, k, v = make(B, H, Lq, head_dim), make(B, H // group, Lk, head_dim), make(B, H // group, Lk, head_dim)
    grad = torch.randn(B, H, Lq, head_dim, dtype=torch.bfloat16, device=DEVICE)
    _assert_padded_grads(q, k, v, grad, {"key_padding_mask": pad}, deterministic)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("group", [1, 4])
def test_padded_key_blocks_causal_deterministic(head_dim, alignment, group):
    """A skipped key block under causality passes on its dQ turns from its first query block
    (first_query_block), not from 0, and up to the last: right-padded key blocks past the diagonal
    start late (top-left, Lq < Lk; bottom-right shifts them). Passing a turn the consumers never
    take, or missing one, hangs the key blocks after it. Gradients against float64; the padded
    keys' dK and dV exactly zero."""
    B, H, Lq, Lk = 5, 4, 700, 1000
    pad = padded_batch_mask(B, Lk, DEVICE)
    make = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)  # noqa: E731
    q, k, v = make(B, H, Lq, head_dim), make(B, H // group, Lk, head_dim), make(B, H // group, Lk, head_dim)
    grad = torch.randn(B, H, Lq, head_dim, dtype=torch.bfloat16, device=DEVICE)
    masks = {"is_causal": True, "causal_alignment": alignment, "key_padding_mask": pad}
    _assert_padded_grads(q, k, v, grad, masks, True)


# ---- The sliding window at the cost of its window (end_query_block, dq_turn in
# hopper/flash_bwd_sm90_kernel.cuh): poison outside every window, and the deterministic order of
# the key blocks visiting a query block, a range [first(m), last(m)] under a window.


def _check_windowed(got, clean, grad, masks, dtype, n):
    """Gradients (finite: no poisoned tile read) against float64 and the plain same-dtype
    computation on the clean tensors."""
    for g, name in zip(got, "qkv"):
        assert torch.isfinite(g).all(), f"grad {name}: a block outside every window was read (NaN)"
    _assert_grads_match(got, clean, grad, masks, dtype, n)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_window_keys_before_every_window_are_not_read(head_dim, deterministic):
    """Bottom-right, 300 queries over 1100 keys (shift 800), window 289: query 0's window starts
    at key 512, so the key blocks of keys 0-255 (every tile size divides 256) see no query. Their
    K and V are NaN: a key block visited there (or a forward tile) puts NaN into dQ."""
    dtype, B, H, Hk, Lq, Lk = torch.bfloat16, 2, 4, 2, 300, 1100
    masks = {"is_causal": True, "causal_alignment": 1, "window": 289}
    q = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(B, Hk, Lk, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :256] = float("nan")
    v_bad[:, :, :256] = float("nan")
    grad = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE)
    inputs = [t.requires_grad_() for t in (q.clone(), k_bad, v_bad)]
    got = _sm90_grads(*inputs, grad, masks, deterministic)[0]
    _check_windowed(got, (q, k, v), grad, masks, dtype, Lk)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_window_queries_after_every_window_are_not_read(head_dim, deterministic):
    """Top-left, 600 queries over 128 keys, window 100: no query from 227 on sees a key, so every
    key block's query loop ends at or before query 256. Q and dO of queries 512 on are NaN: a
    query block visited there puts NaN into dK and dV (P = 0 times dP - delta = NaN)."""
    dtype, B, H, Lq, Lk = torch.bfloat16, 2, 2, 600, 128
    masks = {"is_causal": True, "window": 100}
    q = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(B, H, Lk, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    grad = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE)
    q_bad, grad_bad = q.clone(), grad.clone()
    q_bad[:, :, 512:] = float("nan")
    grad_bad[:, :, 512:] = float("nan")
    grad[:, :, 512:] = 0  # the reference's rows that see no key: any dO gives zero gradients
    inputs = [t.requires_grad_() for t in (q_bad, k.clone(), v.clone())]
    got = _sm90_grads(*inputs, grad_bad, masks, deterministic)[0]
    _check_windowed(got, (q, k, v), grad, masks, dtype, Lq)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("alignment,Lq,Lk", [(0, 2049, 2049), (1, 1025, 2049)], ids=["top_left", "bottom_right"])
def test_window_deterministic_mode_is_reproducible_bit_for_bit(head_dim, alignment, Lq, Lk):
    """Deterministic mode under a window of 300: the key blocks adding to a query block's dQ are a
    range that starts past key block 0 for most query blocks (dq_turn counts turns from its
    start); a group of 4 query heads per key/value head. Two runs equal bit for bit (and no
    deadlock), and right."""
    dtype, B, H, Hk = torch.bfloat16, 2, 8, 2
    masks = {"is_causal": True, "causal_alignment": alignment, "window": 300}
    q = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE, requires_grad=True)
    k, v = (torch.randn(B, Hk, Lk, head_dim, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(2))
    grad = torch.randn(B, H, Lq, head_dim, dtype=dtype, device=DEVICE)
    runs = _sm90_grads(q, k, v, grad, masks, True, runs=2)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    _check_windowed(runs[0], (q, k, v), grad, masks, dtype, max(Lq, Lk))
