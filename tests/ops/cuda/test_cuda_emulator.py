"""The CUDA kernels (csrc/kernels/cuda), run on the CPU by the SIMT emulator
(tests/ops/cuda/cuda_emulator/simt_emulator.h), against float64 references written from the definition.

This checks the kernels' logic where no GPU is at hand: tiling and bounds, masks, online
softmax, fully masked rows, the backward's recomputation and accumulation, cp.async ordering
and the MMA/ldmatrix fragment bookkeeping (the emulator implements those instructions from
the PTX ISA's definitions). It cannot check speed or the hardware's exact rounding: the GPU
tests (tests/ops/cuda/test_cuda.py, scripts/gpu_check.sh) do that.

Tolerances are relative to each tensor's largest magnitude. float32/float64 run the generic
kernels, which compute in the accumulation type: a few ulps of float32, or float64 noise.
float16/bfloat16 inputs are exact in their dtype; the flash kernels then round the
probabilities to the dtype for the tensor-core P V product and round the output (forward:
two roundings of at most eps/2 each), and the backward also rounds P and dS before its
products and its results (at most four): hence 2 eps for outputs and 4 eps for gradients.
"""
from __future__ import annotations

import math

import pytest
import torch

from cuda_emulator.build import alignment_checked
from cuda_emulator.testing import EMULATOR_MARKS, TOL_GRAD, TOL_OUT, runs_generic_kernels
from helpers import assert_parity, padding_mask, reference_attention
from helpers import MASKS as SHARED_MASKS

pytestmark = EMULATOR_MARKS


@pytest.fixture(scope="module")
def emu_ops():
    """The emulated kernels with the preview switch on (csrc/kernels/cuda/dispatch_policy.h): these
    tests check every path the kernels have, the ones still waiting for a GPU included;
    tests/ops/cuda/test_cuda_split_kv.py checks what runs with the switch off."""
    from cuda_emulator.build import load

    ops = load()
    ops.set_preview(True)
    return ops


# The emulated device, cp.async ordering and thread schedule the current tests run under (see
# the emu fixture).
ACTIVE = {"arch": 90, "order": "late", "schedule": "ascending"}


# Every kernel test runs twice: cp.async copies landing at the wait (late) on an emulated sm_90
# with the block's lowest warps running first, and landing as soon as issued (early) on an
# emulated sm_80 with the highest first — both orderings of the copies (a read before the wait,
# and a refill before the readers are done, each change the results), both directions a missing
# barrier between two warps can go wrong in, and both devices' dispatch (the device reports the
# compute capability asked for).
@pytest.fixture(scope="module", params=[("late", 90, "ascending"), ("early", 80, "descending")],
                ids=["late-sm90", "early-sm80"])
def emu(request, emu_ops):
    ACTIVE["order"], ACTIVE["arch"], ACTIVE["schedule"] = request.param
    emu_ops.set_cp_async_order(ACTIVE["order"])
    emu_ops.set_arch(ACTIVE["arch"])
    emu_ops.set_schedule(ACTIVE["schedule"])
    yield emu_ops
    ACTIVE["order"], ACTIVE["arch"], ACTIVE["schedule"] = "late", 90, "ascending"
    emu_ops.set_cp_async_order("late")
    emu_ops.set_arch(90)
    emu_ops.set_schedule("ascending")


@pytest.fixture(autouse=True)
def _generic_kernels_once(request):
    """The generic kernels (float32/float64, and the tests that force the generic path) issue no
    cp.async and are dispatched alike on sm_80 and sm_90: their early-sm80 pass would repeat the
    late-sm90 one, at the cost of minutes of CI, so it is skipped with this reason."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or callspec.params.get("emu") != ("early", 80):
        return
    if runs_generic_kernels(request.node.name, callspec.params):
        pytest.skip("generic kernels: no cp.async and the same dispatch on sm_80 as on sm_90 (run as late-sm90)")


# The shared mask kinds, with a float16 mask for the flash kernels' half-mask path in place of
# the float32 [B, 1, Lq, Lk] one.
MASKS = {n: f for n, f in SHARED_MASKS.items() if n != "float_4d_broadcast_heads"}
MASKS["float16_4d_broadcast_heads"] = lambda B, H, Lq, Lk: {"attn_mask": torch.randn(B, 1, Lq, Lk).half()}


def _run(emu, dtype, B, H, Lq, Lk, D, Dv=None, masks=None, need_weights=False, grad_weights=False, make=None,
         softcap=0.0, scale=None, heads_k=None):
    """Forward and backward through the emulated kernels, and the float64 reference's. heads_k:
    the key/value heads (grouped-query attention), H unless given; masks may hold causal_alignment
    and window."""
    Dv = D if Dv is None else Dv
    Hkv = H if heads_k is None else heads_k
    make = make or (lambda *shape: torch.randn(*shape, dtype=dtype))
    q, k, v = make(B, H, Lq, D), make(B, Hkv, Lk, D), make(B, Hkv, Lk, Dv)
    masks = masks or {}
    am, kpm, causal = masks.get("attn_mask"), masks.get("key_padding_mask"), masks.get("is_causal", False)
    alignment, window = int(masks.get("causal_alignment", 0)), int(masks.get("window", 0))
    out, lse, weights = emu.forward(q, k, v, am, kpm, causal, scale, need_weights, softcap, alignment, window)
    grad_out = torch.randn(B, H, Lq, Dv, dtype=dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    gw = torch.randn(B, H, Lq, Lk, dtype=acc) if grad_weights else None
    grads = emu.backward(grad_out, gw, q, k, v, lse, am, kpm, causal, scale, softcap, alignment, window)

    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_p = reference_attention(*ref_in, scale=scale, softcap=softcap, **masks)
    loss = (ref_out * grad_out.double()).sum() + ((ref_p * gw.double()).sum() if grad_weights else 0)
    ref_grads = torch.autograd.grad(loss, ref_in, allow_unused=True)
    ref_grads = [torch.zeros_like(t) if g is None else g for g, t in zip(ref_grads, ref_in)]
    return dict(q=q, k=k, v=v, out=out, lse=lse, weights=weights, grads=grads,
                ref_out=ref_out, ref_p=ref_p, ref_grads=ref_grads, masks=masks)


def _assert_close(actual, expected, tol, what, scale=1.0):
    """assert_parity at the configuration's scale: the unit-normal inputs' (1) unless told
    otherwise, so that an exactly-zero reference (dQ when each query sees one key) is compared
    at the rounding level of its inputs, not its own."""
    assert_parity(actual, expected, tol, what, scale=scale)


def _check(r, dtype):
    _assert_close(r["out"], r["ref_out"], TOL_OUT[dtype], "output")
    assert r["out"].dtype == dtype
    for g, w, name in zip(r["grads"], r["ref_grads"], "qkv"):
        assert g.dtype == dtype
        _assert_close(g, w, TOL_GRAD[dtype], f"grad {name}")


def _token_major(t):
    """[B, H, L, D] -> the same values in [B, L, H, D] memory, as the layer op hands them over."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _pairwise(dtypes, head_dims):
    """(dtype, head_dim, causal): every dtype with every head dim, causality alternating so that
    each head dim and each dtype also meets both causal settings: all pairs of values, in 6
    cases instead of the 12 of the full product (the three are independent template parameters
    of the tile code; the full product cost about a minute more of CI at the emulator's speed)."""
    cases = []
    for i, dtype in enumerate(dtypes):
        for j, head_dim in enumerate(head_dims):
            causal = bool((i + j) % 2)
            name = f"{str(dtype)[6:]}-{head_dim}-{'causal' if causal else 'full'}"
            cases.append(pytest.param(dtype, head_dim, causal, id=name))
    return cases


@pytest.mark.parametrize("dtype,head_dim,causal", _pairwise([torch.float16, torch.bfloat16], [32, 64, 128]))
def test_flash_kernels_match_reference(emu, dtype, head_dim, causal):
    # Lengths that are not multiples of any tile, both Lq > Lk and Lq < Lk.
    seqlen_q, seqlen_k = (67, 131) if causal else (131, 67)
    q = torch.randn(1, 1, 8, head_dim, dtype=dtype)
    assert emu.uses_tensor_cores(q, q, q)
    r = _run(emu, dtype, 1, 1, seqlen_q, seqlen_k, head_dim, masks={"is_causal": causal},
             make=lambda *s: _token_major(torch.randn(*s, dtype=dtype)))
    _check(r, dtype)
    lse_ref = torch.logsumexp(torch.where(
        r["ref_p"] > 0, torch.einsum("bhid,bhjd->bhij", r["q"].double(), r["k"].double()) / math.sqrt(head_dim), -math.inf), -1)
    _assert_close(r["lse"], lse_ref, 1e-5, "logsumexp")  # float32, from exact 16-bit inputs


# (head_dim, head_dim_v, dtype, causal): the compiled sizes above 128 and 96, and dims between
# them run on the next compiled size with the padding masked (kFlashHeadDims, kernel_traits.h).
FLASH_HEAD_DIM_CASES = [
    (96, 96, torch.float16, True),      # compiled
    (192, 192, torch.bfloat16, False),  # compiled, dK/dV split over two warps per 16 keys
    (256, 256, torch.float16, True),    # compiled, 16-query backward steps
    (40, 40, torch.bfloat16, True),     # on 64
    (80, 80, torch.float16, False),     # on 96
    (160, 160, torch.bfloat16, True),   # on 192
    (200, 200, torch.float16, False),   # on 256
    (64, 128, torch.bfloat16, False),   # head_dim_v above head_dim: on 128, q/k padded
    (112, 48, torch.float16, True),     # head_dim_v below head_dim: on 128, v/out padded
]


@pytest.mark.parametrize("head_dim,head_dim_v,dtype,causal", [
    pytest.param(*case, id=f"{case[0]}-{case[1]}-{str(case[2])[6:]}-{'causal' if case[3] else 'full'}")
    for case in FLASH_HEAD_DIM_CASES])
def test_flash_kernels_every_head_dim(emu, head_dim, head_dim_v, dtype, causal):
    # Token-major [B, L, H, D] memory with 2 heads: a padded load that is not masked reads the
    # next head's columns, a padded store that is not masked overwrites them.
    B, H, Lq, Lk = 1, 2, 37, 45
    make = lambda *s: _token_major(torch.randn(*s, dtype=dtype))
    q, v = make(1, 1, 8, head_dim), make(1, 1, 8, head_dim_v)
    assert emu.uses_tensor_cores(q, q, v)
    r = _run(emu, dtype, B, H, Lq, Lk, head_dim, Dv=head_dim_v, masks={"is_causal": causal}, make=make)
    _check(r, dtype)


@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
def test_padded_head_dims_with_grouped_query_heads(emu, alignment):
    # head dim 80 on 96, head_dim_v 48, two query heads per key/value head, token-major.
    dtype, B, H, Lq, Lk = torch.float16, 1, 4, 45, 37
    make = lambda *s: _token_major(torch.randn(*s, dtype=dtype))
    r = _run(emu, dtype, B, H, Lq, Lk, 80, Dv=48, masks={"is_causal": True, "causal_alignment": alignment},
             make=make, heads_k=2)
    _check(r, dtype)


@pytest.mark.parametrize("head_dim,head_dim_v", [(36, 36), (64, 60), (264, 264), (128, 264)])
def test_head_dims_the_flash_kernels_refuse(emu_ops, head_dim, head_dim_v):
    # Not a multiple of 8 elements (the padded loads move 16-byte chunks), or above 256.
    q, v = torch.randn(1, 1, 8, head_dim).half(), torch.randn(1, 1, 8, head_dim_v).half()
    assert not emu_ops.uses_tensor_cores(q, q, v)


@pytest.mark.parametrize("mask", list(MASKS))
def test_flash_kernels_every_mask(emu, mask):
    B, H, Lq, Lk = 2, 2, 33, 47
    r = _run(emu, torch.float16, B, H, Lq, Lk, 64, masks=MASKS[mask](B, H, Lq, Lk))
    _check(r, torch.float16)


GENERIC_MASKS = ("none", "bool_3d", "causal+padding+float")


def _two_masks_each(dtypes):
    """(dtype, mask) with two of GENERIC_MASKS per dtype, rotating, so that every mask meets at
    least two dtypes: the generic kernels' dtype and mask code paths are independent of each
    other, and the full product cost about a minute of CI at the emulator's speed."""
    return [pytest.param(dtype, GENERIC_MASKS[(i + j) % 3], id=f"{str(dtype)[6:]}-{GENERIC_MASKS[(i + j) % 3]}")
            for i, dtype in enumerate(dtypes) for j in range(2)]


@pytest.mark.parametrize("dtype,mask", _two_masks_each([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_generic_kernels_odd_head_dims(emu, dtype, mask):
    # head_dim 36, head_dim_v 20: not multiples of 8 elements (16 bytes), so the generic kernels run.
    B, H, Lq, Lk = 2, 1, 19, 37
    q = torch.randn(1, 1, 8, 36, dtype=dtype)
    assert not emu.uses_tensor_cores(q, q, q[..., :20].contiguous())
    r = _run(emu, dtype, B, H, Lq, Lk, 36, Dv=20, masks=MASKS[mask](B, H, Lq, Lk))
    _check(r, dtype)


def test_generic_kernels_large_head_dim(emu):
    r = _run(emu, torch.float32, 1, 1, 5, 9, 300)  # 8 < 300 / 32 <= 16 elements per lane
    _check(r, torch.float32)


def test_unaligned_half_rows_take_the_generic_path(emu):
    # A head-dim-64 view whose rows are 2 elements (4 bytes) off a 16-byte boundary.
    base = torch.randn(1, 1, 9, 66, dtype=torch.float16)
    q = base[..., 2:]
    assert not emu.uses_tensor_cores(q, q, q)
    out, _, _ = emu.forward(q, q, q, None, None, False, None, False)
    _assert_close(out, reference_attention(q, q, q)[0], TOL_OUT[torch.float16], "output")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_weights_and_their_gradient(emu, dtype):
    B, H, Lq, Lk = 2, 2, 21, 35
    r = _run(emu, dtype, B, H, Lq, Lk, 64, masks=MASKS["causal+padding+float"](B, H, Lq, Lk),
             need_weights=True, grad_weights=True)
    _check(r, dtype)
    assert r["weights"].dtype == dtype and r["weights"].is_contiguous()
    _assert_close(r["weights"], r["ref_p"], TOL_OUT[dtype], "weights")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fully_masked_rows_give_zeros_and_zero_gradients(emu, dtype):
    B, H, Lq, Lk = 2, 1, 20, 70
    mask = torch.zeros(Lq, Lk, dtype=torch.bool)
    mask[3] = True                                      # one query row sees nothing
    padding = torch.zeros(B, Lk, dtype=torch.bool)
    padding[1] = True                                   # batch 1 sees nothing at all
    r = _run(emu, dtype, B, H, Lq, Lk, 64, masks={"attn_mask": mask, "key_padding_mask": padding})
    out, lse = r["out"], r["lse"]
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isneginf(lse[:, :, 3]).all() and torch.isneginf(lse[1]).all()
    dq, dk, dv = r["grads"]
    assert torch.equal(dq[1], torch.zeros_like(dq[1])) and torch.equal(dq[:, :, 3], torch.zeros_like(dq[:, :, 3]))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
    _check(r, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 7), (7, 1), (0, 5), (5, 0)])
def test_degenerate_lengths(emu, dtype, seqlen_q, seqlen_k):
    r = _run(emu, dtype, 1, 2, seqlen_q, seqlen_k, 32, masks={"is_causal": True})
    _check(r, dtype)
    if seqlen_k == 0:
        assert torch.isneginf(r["lse"]).all()


def test_causal_keys_no_query_sees_get_zero_gradients(emu):
    # Lk > Lq with top-left causality: keys past the last query are never attended.
    r = _run(emu, torch.bfloat16, 1, 1, 40, 200, 64, masks={"is_causal": True})
    _check(r, torch.bfloat16)
    dk, dv = r["grads"][1], r["grads"][2]
    assert torch.equal(dk[:, :, 40:], torch.zeros_like(dk[:, :, 40:]))
    assert torch.equal(dv[:, :, 40:], torch.zeros_like(dv[:, :, 40:]))


# Grouped-query attention and the bottom-right causal alignment through both kernel families:
# the flash kernels (float16/bfloat16, head dims 32/64) and the generic ones (float32, head dim
# 40). Lq < Lk and Lq > Lk (bottom-right: the first Lq - Lk rows see no key), several tiles each
# way, so that the causal tile skipping and the per-key-block query range follow the shift.
GQA_CASES = [
    pytest.param(torch.float16, 64, 4, 1, 37, 150, "causal", id="f16-d64-group4-bottom_right-q<k"),
    pytest.param(torch.bfloat16, 32, 2, 1, 150, 37, "causal", id="bf16-d32-group2-bottom_right-q>k"),
    pytest.param(torch.float16, 64, 8, 0, 45, 70, "causal+padding+float", id="f16-d64-mqa-top_left-masks"),
    pytest.param(torch.float16, 32, 2, 1, 70, 45, "causal+padding+float", id="f16-d32-group2-bottom_right-masks"),
    pytest.param(torch.float32, 40, 4, 1, 19, 37, "causal+padding+float", id="generic-f32-group4-bottom_right"),
    pytest.param(torch.float32, 40, 2, 1, 37, 19, "causal", id="generic-f32-group2-bottom_right-q>k"),
]


@pytest.mark.parametrize("dtype,D,group,alignment,Lq,Lk,mask", GQA_CASES)
def test_gqa_and_bottom_right_causal(emu, dtype, D, group, alignment, Lq, Lk, mask):
    # Emulation time (CI): one batch row where no mask tells the rows apart (the padded cases keep
    # two, and test_flash_kernels_every_mask checks the batch strides under every mask); the
    # generic kernels emulate a warp per query row (and per key row in the backward), each
    # streaming every key: 4 query heads keep their groups of 4 and 2 at half of 8 heads' time.
    B = 2 if "padding" in mask else 1
    H = 4 if dtype == torch.float32 else 8
    masks = {**MASKS[mask](B, H, Lq, Lk), "causal_alignment": alignment}
    r = _run(emu, dtype, B, H, Lq, Lk, D, masks=masks, heads_k=H // group)
    assert r["grads"][1].shape == r["k"].shape and r["grads"][2].shape == r["v"].shape
    _check(r, dtype)
    hidden = Lq - Lk if alignment == 1 else 0  # rows that see no key
    if hidden > 0:
        assert torch.equal(r["out"][:, :, :hidden], torch.zeros_like(r["out"][:, :, :hidden]))
        assert torch.isneginf(r["lse"][:, :, :hidden]).all()


def test_matches_the_cpu_operator(emu):
    """Same inputs through the CPU op and the emulated CUDA kernels: the two bindings agree."""
    import attn_export

    q, k, v = (torch.randn(2, 2, 23, 64, dtype=torch.float32) for _ in range(3))
    padding = padding_mask(2, 23)
    cpu_out, cpu_lse, cpu_w = torch.ops.attn_export._attention_forward(q, k, v, None, padding, True, 0.3, True)
    out, lse, w = emu.forward(q, k, v, None, padding, True, 0.3, True)
    for a, b, name in ((out, cpu_out, "output"), (lse, cpu_lse, "lse"), (w, cpu_w, "weights")):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype, name
        assert_parity(a, b, 2e-6, name, n=64)
    grad = torch.randn_like(out)
    cpu_grads = torch.ops.attn_export._attention_backward(grad, None, q, k, v, cpu_lse, None, padding, True, 0.3)
    grads = emu.backward(grad, None, q, k, v, lse, None, padding, True, 0.3)
    for a, b, name in zip(grads, cpu_grads, "qkv"):
        assert a.shape == b.shape and a.stride() == b.stride(), name
        assert_parity(a, b, 1e-5, f"grad {name}", scale=cpu_grads, n=64)
    assert attn_export  # the CPU operators are registered by the import


# Logit soft-capping: the flash kernels cap in float32 before the log2-domain masks, the
# generic ones in the accumulation type; both multiply dS by 1 - tanh^2 in the backward.
# softcap 0.5 saturates tanh for most unit-normal scores at head dim 64; 3 barely caps them.
SOFTCAP_MASKS = ("none", "causal", "bool_4d_full", "causal+padding+float", "float16_4d_broadcast_heads")
SOFTCAP_SETTINGS = [(dtype, softcap) for dtype in (torch.float16, torch.bfloat16) for softcap in (0.5, 3.0)]


def _softcap_cases():
    """Each mask under two opposite (dtype, softcap) settings, alternating between the two
    opposite pairs: every mask meets both dtypes and both caps, every setting two or three masks
    (10 cases for the full product's 20; the cap, the dtype and the mask are separate steps of
    the kernel)."""
    cases = []
    for i, mask in enumerate(SOFTCAP_MASKS):
        for index in ((0, 3), (1, 2))[i % 2]:
            dtype, softcap = SOFTCAP_SETTINGS[index]
            cases.append(pytest.param(dtype, softcap, mask, id=f"{str(dtype)[6:]}-{softcap}-{mask}"))
    return cases


@pytest.mark.parametrize("dtype,softcap,mask", _softcap_cases())
def test_flash_kernels_softcap(emu, dtype, softcap, mask):
    B, H, Lq, Lk = 2, 2, 33, 47
    q = torch.randn(1, 1, 8, 64, dtype=dtype)
    assert emu.uses_tensor_cores(q, q, q)
    r = _run(emu, dtype, B, H, Lq, Lk, 64, masks=MASKS[mask](B, H, Lq, Lk), softcap=softcap, scale=0.5)
    _check(r, dtype)


@pytest.mark.parametrize("dtype,mask", _two_masks_each([torch.float32, torch.float64, torch.float16]))
def test_generic_kernels_softcap(emu, dtype, mask):
    B, H, Lq, Lk = 2, 1, 19, 37
    r = _run(emu, dtype, B, H, Lq, Lk, 36, Dv=20, masks=MASKS[mask](B, H, Lq, Lk), softcap=1.5, scale=0.6)
    _check(r, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_softcap_weights_and_their_gradient(emu, dtype):
    B, H, Lq, Lk = 2, 2, 21, 35
    r = _run(emu, dtype, B, H, Lq, Lk, 64, masks=MASKS["causal+padding+float"](B, H, Lq, Lk),
             need_weights=True, grad_weights=True, softcap=2.0)
    _check(r, dtype)
    _assert_close(r["weights"], r["ref_p"], TOL_OUT[dtype], "weights")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_softcap_fully_masked_rows_give_zeros(emu, dtype):
    B, H, Lq, Lk = 2, 1, 20, 70
    mask = torch.zeros(Lq, Lk, dtype=torch.bool)
    mask[3] = True
    padding = torch.zeros(B, Lk)
    padding[1] = -math.inf
    r = _run(emu, dtype, B, H, Lq, Lk, 64, masks={"attn_mask": mask, "key_padding_mask": padding}, softcap=1.0)
    assert torch.equal(r["out"][:, :, 3], torch.zeros_like(r["out"][:, :, 3]))
    assert torch.equal(r["out"][1], torch.zeros_like(r["out"][1]))
    assert all(torch.isfinite(g).all() for g in r["grads"])
    _check(r, dtype)


def test_softcap_matches_the_cpu_operator(emu):
    import attn_export

    q, k, v = (torch.randn(2, 2, 23, 64, dtype=torch.float32) for _ in range(3))
    padding = padding_mask(2, 23)
    cpu_out, cpu_lse, cpu_w = torch.ops.attn_export._attention_forward(q, k, v, None, padding, True, 0.3, True, 0.8)
    out, lse, w = emu.forward(q, k, v, None, padding, True, 0.3, True, 0.8)
    for a, b, name in ((out, cpu_out, "output"), (lse, cpu_lse, "lse"), (w, cpu_w, "weights")):
        assert_parity(a, b, 2e-6, name, n=64)
    grad = torch.randn_like(out)
    cpu_grads = torch.ops.attn_export._attention_backward(grad, None, q, k, v, cpu_lse, None, padding, True, 0.3,
                                                           None, 0.8)
    grads = emu.backward(grad, None, q, k, v, lse, None, padding, True, 0.3, 0.8)
    for a, b, name in zip(grads, cpu_grads, "qkv"):
        assert_parity(a, b, 1e-5, f"grad {name}", scale=cpu_grads, n=64)
    assert attn_export


# ---- The emulator itself: as strict as a GPU, and its MMA/ldmatrix tables right.

# Each case does one thing a GPU refuses or faults on, or its legal twin (expected error ""):
# the launch limits, the 48 KB shared-memory default and the device's opt-in maximum (163 KB on
# sm_80, 227 KB on sm_90), guard zones, alignment, shuffle masks and warp divergence.
SELFTESTS = {
    "threads_1024": "",
    "threads_1025": "blockDim.x = 1025 (limit 1024)",
    "block_z_65": "blockDim.z = 65",
    "grid_y_65536": "gridDim.y = 65536",
    "smem_48k": "",
    "smem_48k_plus_1": "needs cudaFuncSetAttribute",
    "smem_100k_opted_in": "",
    "smem_200k_opted_in": {80: "opt-in maximum of sm_80", 90: ""},
    "smem_write_last": "",
    "smem_write_past_end": "shared memory written out of bounds",
    "smem_write_before_start": "shared memory written out of bounds",
    "global_write_last": "",
    "global_write_past_end": "global memory written out of bounds",
    "cp_async_in_bounds": "",
    "cp_async_past_end": "outside every global buffer",
    "cp_async_misaligned": "not 16-byte aligned",
    "cp_async_smem_overflow": "outside the block's",
    "ldmatrix_aligned": "",
    "ldmatrix_misaligned": "not 16-byte aligned",
    "ldmatrix_past_end": "outside the block's",
    "ldmatrix_partial_warp": "need all 32 lanes",
    "shfl_full_mask": "",
    "shfl_half_mask": "not in its mask",
    "shfl_mask_of_partial_warp": "",
    "shfl_mask_beyond_partial_warp": "do not execute it",
    "divergent_collectives": "warp divergence",
    "barrier_skipped": "deadlock in block (0, 0, 0)",
    "shfl_in_half_a_warp": "at a warp-synchronous instruction of warp 0",
    "exchange_synced": "",
    "exchange_unsynced": "for the slot of thread",
    "store_pair_aligned": "",
    "store_pair_misaligned": "misaligned 4-byte access",
}


NEEDS_ALIGNMENT_SANITIZER = {"store_pair_misaligned"}  # a plain typed store: -fsanitize=alignment catches it


@pytest.mark.parametrize("arch, schedule", [(80, "descending"), (90, "ascending")])
def test_emulator_fails_where_a_gpu_would(emu_ops, arch, schedule):
    emu_ops.set_arch(arch)
    emu_ops.set_schedule(schedule)
    try:
        results = {name: emu_ops.selftest(name) for name in SELFTESTS}
    finally:
        emu_ops.set_arch(ACTIVE["arch"])
        emu_ops.set_schedule(ACTIVE["schedule"])
    for name, expected in SELFTESTS.items():
        if name in NEEDS_ALIGNMENT_SANITIZER and not alignment_checked():
            continue  # ATTN_EXPORT_EMU_ALIGNMENT=0 (make test): no typed access is checked
        expected = expected[arch] if isinstance(expected, dict) else expected
        if expected:
            assert expected in results[name], f"{name} on sm_{arch}: {results[name]!r}"
        else:
            assert results[name] == "", f"{name} on sm_{arch}: {results[name]!r}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_k_major", [False, True], ids=["b_n_major", "b_k_major"])
def test_fragment_tables_give_a_known_product(emu_ops, dtype, b_k_major):
    """One 16x16 by 16x8 product through ldmatrix (.trans for a k-major B) and mma.sync, loaded
    as the flash kernels load their operands: small integers, so the float64 answer is exact."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (16, 16), generator=g).to(dtype)
    b = torch.randint(-4, 5, (16, 8), generator=g).to(dtype)
    d = emu_ops.mma_product(a, b.contiguous() if b_k_major else b.t().contiguous(), b_k_major)
    assert torch.equal(d.double(), a.double() @ b.double())


def test_sm75_runs_the_generic_kernels(emu_ops):
    # No mma.sync m16n8k16 before sm_80: the dispatch must not pick the flash kernels there.
    q = torch.randn(1, 2, 19, 64, dtype=torch.float16)
    emu_ops.set_arch(75)
    try:
        assert not emu_ops.uses_tensor_cores(q, q, q)
        out = emu_ops.forward(q, q, q, None, None, True, None, False)[0]
    finally:
        emu_ops.set_arch(ACTIVE["arch"])
    assert emu_ops.uses_tensor_cores(q, q, q)
    _assert_close(out, reference_attention(q, q, q, is_causal=True)[0], TOL_OUT[torch.float16], "output")
