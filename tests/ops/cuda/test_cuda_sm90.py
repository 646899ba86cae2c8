"""The Hopper (sm_90a) forward on a Hopper GPU: parity with the float64 reference (and, through the
backward, which reads its log-sum-exp, gradients) at every compiled head dim (32, 64, 96, 128, 192,
256: both schedules of the tile table, ping-pong with overlap and serial), fp16 and bf16, every
mask kind, both causal alignments, the window, grouped-query heads (1 and 8 query heads per key/value head), odd lengths and fully masked
rows, padded batches (the padded key tiles skipped); each test checks with the profiler that the
sm_90a kernel ran, so none passes on the sm80 path by accident. Decode-shaped work is the sm80
forward's (split-KV, packed grouped heads: forward_plan.h hopper_forward_declines): the parity
tests take batches that fill the SMs (sm90_gpu.filling_batch), and the decode tests check that the
sm80 kernels ran instead.

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
from sm90_gpu import BF16, DEVICE, F16, HEAD_DIMS, assert_ran, over_masks, over_shapes, filling_batch, kernels_run, nan_padded, padded_batch_mask

KERNEL = "flash_fwd_sm90_kernel"

pytestmark = pytest.mark.cuda

# The quick tier (-m sm90_quick; tests/conftest.py marks these): one case per code path, head dims
# and dtypes alternating, every test function at least once (tests/ops/cuda/test_cuda_sm90_quick.py);
# half of the mask kinds here, the other half in test_cuda_sm90_bwd.py (check_core runs both
# directions). Each entry: (test, parameters picking exactly one case).
SM90_QUICK = [
    *(("test_matches_reference", dict(dtype=t, head_dim=d, causal=c, seqlen=n)) for t, d, c, n in [
        (F16, 32, True, 1025), (BF16, 64, False, 97), (F16, 96, True, 1025), (BF16, 128, True, 1025),
        (F16, 192, False, 1025), (BF16, 256, True, 97)]),
    *(("test_masks", dict(dtype=t, head_dim=d, mask=m)) for t, d, m in [
        (F16, 32, "bool_2d"), (BF16, 96, "bool_4d_full"), (F16, 128, "causal+padding+float"),
        (BF16, 192, "float_4d_broadcast_heads"), (F16, 256, "padding_bool")]),
    ("test_softcap_and_window", dict(head_dim=128, softcap=None, window=50)),
    ("test_softcap_and_window", dict(head_dim=256, softcap=5.0, window=0)),
    *(("test_grouped_query_heads_and_causal_alignment", dict(dtype=t, head_dim=d, group=g, alignment=a, Lq=q, Lk=k))
      for t, d, g, a, q, k in [(BF16, 128, 8, 0, 97, 1025), (F16, 64, 8, 1, 1025, 97), (BF16, 256, 1, 1, 1025, 97)]),
    ("test_fully_masked_rows_give_zero_and_minus_inf_lse", dict(head_dim=128)),
    ("test_padded_batches", dict(dtype=F16, head_dim=64, causal={}, kind="bool")),
    ("test_padded_batches", dict(dtype=BF16, head_dim=192, causal={"is_causal": True, "causal_alignment": 1},
                                 kind="additive")),
    ("test_padded_key_tiles_are_not_loaded", dict(head_dim=192)),
    ("test_decode_runs_on_the_sm80_path", dict(dtype=BF16, path="split", Hkv=8, Lq=1)),
    ("test_decode_runs_on_the_sm80_path", dict(dtype=F16, path="packed")),
    ("test_decode_runs_on_the_sm80_path", dict(dtype=BF16, path="hopper")),
    ("test_strides_tma_refuses_fall_back_to_the_sm80_path", {}),
    ("test_rows_past_the_ends_are_zero_filled_not_read", dict(head_dim=64, layout="blhd", causal=True)),
    ("test_rows_past_the_ends_are_zero_filled_not_read", dict(head_dim=256, layout="bhld", causal=False)),
    ("test_fully_masked_rows_beside_visible_ones", dict(head_dim=256)),
]


def _kernels_run(fn) -> set[str]:
    return kernels_run(fn, "the sm_90a forward")


def _assert_ran(ran: set[str]) -> None:
    assert_ran(ran, KERNEL, "the sm_90a forward")


def _check(dtype, B, H, Lq, Lk, D, masks, softcap=None):
    """check_core on the Hopper forward; `masks`: a dict, or a function of the batch size giving one
    (the batch grows to fill the SMs: filling_batch)."""
    B = filling_batch(B, H, Lq)
    masks = masks(B) if callable(masks) else masks
    _assert_ran(_kernels_run(lambda: check_core(DEVICE, dtype, B, H, Lq, Lk, D, masks, softcap=softcap)))


@over_shapes
def test_matches_reference(dtype, head_dim, causal, seqlen):
    _check(dtype, 2, 3, seqlen, seqlen, head_dim, {"is_causal": causal})


@over_masks
def test_masks(dtype, head_dim, mask):
    H, Lq, Lk = 3, 97, 301
    _check(dtype, 2, H, Lq, Lk, head_dim, lambda B: MASKS[mask](B, H, Lq, Lk, device=DEVICE))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("window", [0, 50])
def test_softcap_and_window(head_dim, softcap, window):
    masks = {"is_causal": True, "window": window} if window else {"is_causal": True}
    _check(torch.bfloat16, 2, 2, 300, 300, head_dim, masks, softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("group,Lq,Lk", [(1, 97, 1025), (1, 1025, 97), (1, 1, 4096), (8, 97, 1025), (8, 1025, 97)])
def test_grouped_query_heads_and_causal_alignment(dtype, head_dim, group, alignment, Lq, Lk):
    """Key/value head h // group read in place by TMA; Lq > Lk bottom-right leaves rows with no key.
    (One query with 8 heads a group is decode, the sm80 forward's: test_decode_runs_on_the_sm80_path.)"""
    H = 8
    B = filling_batch(2, H, Lq, group)
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE)  # noqa: E731
    q, k, v = make(B, H, Lq, head_dim), make(B, H // group, Lk, head_dim), make(B, H // group, Lk, head_dim)
    masks = {"is_causal": True, "causal_alignment": alignment}
    out = {}
    _assert_ran(_kernels_run(lambda: out.setdefault("o", attn_export.attention(q, k, v, **masks))))
    exact, _ = reference_attention(q, k, v, **masks)
    plain, _ = reference_attention(q, k, v, dtype=dtype, **masks)
    assert torch.isfinite(out["o"]).all()
    assert_within(out["o"], plain, exact, dtype, "output", max(Lq, Lk, head_dim))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fully_masked_rows_give_zero_and_minus_inf_lse(head_dim):
    """Batch row 1 pads every key: zero output; the backward (which reads lse) stays finite."""
    H, L = 2, 130
    B = filling_batch(2, H, L)
    q, k, v = (torch.randn(B, H, L, head_dim, dtype=torch.float16, device=DEVICE, requires_grad=True) for _ in range(3))
    pad = padding_mask(B, L, device=DEVICE)
    pad[1] = True
    got = {}
    _assert_ran(_kernels_run(lambda: got.setdefault("o", attn_export.attention(q, k, v, key_padding_mask=pad))))
    out = got["o"]
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


# Key-tile rows of the Hopper forward per head dim (hopper/flash_fwd_sm90.h fwd_tile).
FWD_BLOCK_N = {32: 128, 64: 128, 96: 128, 128: 128, 192: 112, 256: 80}


def _additive(pad: torch.Tensor) -> torch.Tensor:
    return torch.zeros(pad.shape, device=pad.device).masked_fill(pad, float("-inf"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", [{}, {"is_causal": True, "causal_alignment": 1}], ids=["full", "bottom_right"])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_padded_batches(dtype, head_dim, causal, kind):
    """Right and left padding, every key padded, interior holes (sm90_gpu.padded_batch_mask), the
    padded key tiles skipped (ATTN_EXPORT_CUDA_PREVIEW=1): output and gradients against float64,
    and a row whose keys are all padded gives exactly zero."""
    H, Lq, Lk = 2, 97, 1000
    B = filling_batch(5, H, Lq)
    pad = padded_batch_mask(B, Lk, DEVICE)
    masks = {**causal, "key_padding_mask": pad if kind == "bool" else _additive(pad)}
    _check(dtype, B, H, Lq, Lk, head_dim, masks)
    q, k, v = (torch.randn(B, H, n, head_dim, dtype=dtype, device=DEVICE) for n in (Lq, Lk, Lk))
    out = attn_export.attention(q, k, v, **masks)
    assert torch.equal(out[2::5], torch.zeros_like(out[2::5]))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_padded_key_tiles_are_not_loaded(head_dim):
    """Skipping shown, not assumed: K and V are NaN at every key outside each batch row's visible
    span rounded out to whole key tiles (right, left and full padding). A padded tile that were
    loaded would turn its rows' output into NaN (its probabilities are 0, 0 x NaN); skipped, the
    output matches the float64 reference on the clean K and V."""
    H, Lq, Lk, block_n = 2, 97, 1000, FWD_BLOCK_N[head_dim]
    B = filling_batch(3, H, Lq)
    keys = torch.arange(Lk, device=DEVICE)
    pad = torch.zeros(B, Lk, dtype=torch.bool, device=DEVICE)
    pad[0::3] = keys >= Lk // 3
    pad[1::3] = keys < Lk - Lk // 5
    pad[2::3] = True
    q, k, v = (torch.randn(B, H, n, head_dim, dtype=torch.bfloat16, device=DEVICE) for n in (Lq, Lk, Lk))
    k_bad, v_bad = k.clone(), v.clone()
    for b in range(B):
        visible = (~pad[b]).nonzero()
        if len(visible):
            first, last = int(visible[0]) // block_n * block_n, (int(visible[-1]) // block_n + 1) * block_n
            outside = (keys < first) | (keys >= last)
        else:
            outside = torch.ones(Lk, dtype=torch.bool, device=DEVICE)
        k_bad[b, :, outside] = float("nan")
        v_bad[b, :, outside] = float("nan")
    got = {}
    _assert_ran(_kernels_run(lambda: got.setdefault("o", attn_export.attention(q, k_bad, v_bad, key_padding_mask=pad))))
    exact, _ = reference_attention(q, k, v, key_padding_mask=pad)
    plain, _ = reference_attention(q, k, v, dtype=torch.bfloat16, key_padding_mask=pad)
    assert torch.isfinite(got["o"]).all(), "a padded key tile was loaded"
    assert_within(got["o"], plain, exact, torch.bfloat16, "output", Lk)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,path", [
    (1, 32, 8, 1, 32768, "split"),  # one sequence, 4 query heads a key/value head: packed and split
    (1, 32, 32, 1, 32768, "split"),  # multi-head: split
    (1, 32, 8, 5, 8192, "split"),  # a few speculative tokens
    (0, 32, 8, 1, 4096, "packed"),  # enough sequences to fill the SMs (filling_batch): packed, unsplit
    (0, 32, 32, 1, 4096, "hopper"),  # ... multi-head: nothing to pack or split, the Hopper forward
], ids=["gqa_32k", "mha_32k", "gqa_lq5", "gqa_filled", "mha_filled"])
def test_decode_runs_on_the_sm80_path(dtype, B, H, Hkv, Lq, Lk, path):
    """Decode-shaped work stays on the sm80 forward, which splits the keys and packs grouped heads
    (forward_plan.h hopper_forward_declines): the profiler names the kernels that ran."""
    B = B or filling_batch(1, H, Lq, H // Hkv)
    q = torch.randn(B, H, Lq, 128, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(B, Hkv, Lk, 128, dtype=dtype, device=DEVICE) for _ in range(2))
    masks = {"is_causal": True, "causal_alignment": 1}
    got = {}
    ran = _kernels_run(lambda: got.setdefault("o", attn_export.attention(q, k, v, **masks)))
    hopper = any(KERNEL in name for name in ran)
    split = any("flash_fwd_split_kernel" in name for name in ran) and any("split_kv_combine_kernel" in name for name in ran)
    sm80 = any("flash_fwd_kernel" in name for name in ran)
    assert (hopper, split, sm80) == {"split": (False, True, False), "packed": (False, False, True),
                                     "hopper": (True, False, False)}[path], sorted(ran)
    exact, _ = reference_attention(q, k, v, **masks)
    plain, _ = reference_attention(q, k, v, dtype=dtype, **masks)
    assert_within(got["o"], plain, exact, dtype, "output", Lk)


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
    dtype, H, Lq, Lk = torch.bfloat16, 4, 97, 201
    B = filling_batch(2, H, Lq, 2)
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
    dtype, H, Lq, Lk = torch.float16, 2, 97, 160
    B = filling_batch(2, H, Lq)
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
