"""The attention core operator (attn_export.attention) against a float64 reference written
from the definition, plus float64 gradcheck and torch.library.opcheck for every operator.

Tests that hold on every device take a `device` parameter (helpers.DEVICES): the CPU always,
the GPU where there is one and the extension has its CUDA kernels (marked `cuda`, skipped with
the reason otherwise). Each device keeps its own tolerances: the CPU operator's fixed bounds
(helpers.CPU_REL), the GPU's derived ones (helpers.assert_within). What only the GPU has
(tensor-core head dims, long sequences, streams) is in tests/ops/cuda/test_cuda.py."""
import math

import pytest
import torch

import attn_export
from helpers import (
    DEVICES, EPS, MASKS, assert_rel_close, assert_within, check_core, masks_in, on_cuda, padding_mask, qkv,
    reference_attention,
)

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels

ops = torch.ops.attn_export
f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# 257 x 530 x 32 and 300 x 1100 x 16: float32 blocks above 64^3 multiply-adds, which run on
# the tiled kernel of csrc/kernels/cpu/linear_kernel.cpp on AVX-512 CPUs (BLAS elsewhere); the
# latter in two query blocks, so that dK and dV accumulate across blocks. The rest: the
# small-block loops. On the GPU: 77 x 131, head dim 64 (tensor cores for float16).
CPU_SIZES = [(5, 7, 8), (7, 5, 8), (1, 1, 8), (1, 9, 8), (66, 40, 8), (257, 530, 32), (300, 1100, 16)]
EVERY_MASK_CASES = [("cpu", f32, *s) for s in CPU_SIZES] + [on_cuda("cuda", dt, 77, 131, 64) for dt in (f16, f32)]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("device,dtype,seqlen_q,seqlen_k,D", EVERY_MASK_CASES)
def test_forward_and_backward_match_float64_reference(device, dtype, mask, seqlen_q, seqlen_k, D):
    B, H = 2, 3
    check_core(device, dtype, B, H, seqlen_q, seqlen_k, D, MASKS[mask](B, H, seqlen_q, seqlen_k, device))


@pytest.mark.parametrize("device,dtype,sizes,masks,scale", [
    ("cpu", f32, (2, 3, 5, 7, 8, 5), {}, 0.3),
    on_cuda("cuda", f16, (2, 2, 33, 47, 64, 32), {"is_causal": True}, None),
])
def test_head_dim_v_differs_and_explicit_scale(device, dtype, sizes, masks, scale):
    B, H, Lq, Lk, D, Dv = sizes
    check_core(device, dtype, B, H, Lq, Lk, D, masks, Dv=Dv, scale=scale)


def test_boolean_mask_true_means_masked_out():
    q, k, v = qkv(1, 1, 1, 2, 4)
    out = attn_export.attention(q, k, v, attn_mask=torch.tensor([[False, True]]))
    torch.testing.assert_close(out, v[:, :, :1], rtol=0, atol=0)  # only key 0 is visible


def test_causal_is_top_left_aligned():
    q, k, v = qkv(1, 1, 3, 5, 4)
    out = attn_export.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0], rtol=0, atol=0)  # query 0 sees key 0 only


@pytest.mark.parametrize("device,dtype,sizes,row", [
    ("cpu", f32, (2, 2, 4, 3, 8), 2),
    *(on_cuda("cuda", dt, (2, 2, 70, 90, 64), 5) for dt in (f16, bf16, f32)),
])
def test_fully_masked_rows_give_zeros_and_finite_gradients(device, dtype, sizes, row):
    B, H, Lq, Lk, D = sizes
    q, k, v = qkv(B, H, Lq, Lk, D, dtype, requires_grad=True, device=device)
    mask = torch.zeros(Lq, Lk, dtype=torch.bool, device=device)
    mask[row] = True                                      # one query row sees nothing
    padding = torch.zeros(B, Lk, dtype=torch.bool, device=device)
    padding[1] = True                                     # batch 1 sees nothing at all
    out = attn_export.attention(q, k, v, attn_mask=mask, key_padding_mask=padding)
    assert torch.equal(out[:, :, row], torch.zeros_like(out[:, :, row]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    float_mask = torch.zeros(Lq, Lk, device=device).masked_fill(mask, -math.inf)
    out_f = attn_export.attention(q, k, v, attn_mask=float_mask)
    assert torch.equal(out_f[:, :, row], torch.zeros_like(out_f[:, :, row]))
    grads = torch.autograd.grad(out.sum() + out_f.sum(), (q, k, v), retain_graph=True)
    assert all(torch.isfinite(g).all() for g in grads)
    dq1, dk1, _ = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(dq1[1], torch.zeros_like(dq1[1])) and torch.equal(dk1[1], torch.zeros_like(dk1[1]))
    _, lse, _ = ops._attention_forward(q.detach(), k.detach(), v.detach(), mask, padding, False, None, False)
    assert torch.isneginf(lse[:, :, row]).all() and torch.isneginf(lse[1]).all()
    expected, _ = reference_attention(q, k, v, attn_mask=mask, key_padding_mask=padding)
    if device == "cpu":
        assert_rel_close(out, expected, 2e-6, "output")
    else:
        plain, _ = reference_attention(q, k, v, attn_mask=mask, key_padding_mask=padding, dtype=dtype)
        assert_within(out, plain, expected, dtype, "output", max(Lq, Lk, D))


def test_weights_and_lse_from_internal_forward():
    q, k, v = qkv(2, 2, 6, 5, 4)
    out, lse, weights = ops._attention_forward(q, k, v, None, padding_mask(2, 5), False, None, True)
    expected_out, expected_p = reference_attention(q, k, v, key_padding_mask=padding_mask(2, 5))
    assert_rel_close(weights, expected_p, 2e-6, "weights")
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) / 2.0
    s = s.masked_fill(padding_mask(2, 5)[:, None, None, :], -math.inf)
    assert_rel_close(lse, torch.logsumexp(s, -1), 2e-6, "logsumexp")
    _, _, no_weights = ops._attention_forward(q, k, v, None, None, False, None, False)
    assert no_weights.numel() == 0


@pytest.mark.parametrize("dtype", [f16, bf16, f32])
@pytest.mark.parametrize("device", DEVICES)
def test_weights_and_their_gradient(device, dtype):
    """need_weights (the unfused path) and a gradient flowing into the weights, within 2x the
    error of the plain same-dtype computation."""
    B, H, Lq, Lk = 2, 2, 45, 67
    masks = MASKS["causal+padding+float"](B, H, Lq, Lk, device)
    q, k, v = qkv(B, H, Lq, Lk, 64, dtype, requires_grad=True, device=device)
    o, lse, w = ops._attention_forward(q, k, v, masks["attn_mask"], masks["key_padding_mask"], True, None, True)
    exact_o, exact_w = reference_attention(q, k, v, **masks)
    plain_o, plain_w = reference_attention(q, k, v, dtype=dtype, **masks)
    assert w.dtype == dtype and w.is_contiguous()
    assert_within(w, plain_w, exact_w, dtype, "weights", Lk)
    go, gw = torch.randn_like(o), torch.randn(B, H, Lq, Lk, device=device)
    got = ops._attention_backward(go, gw, q, k, v, lse, masks["attn_mask"], masks["key_padding_mask"], True, None)
    loss = (exact_o * go.double()).sum() + (exact_w * gw.double()).sum()
    want = torch.autograd.grad(loss, (q, k, v))
    plain = torch.autograd.grad((plain_o * go).sum() + (plain_w * gw.to(dtype)).sum(), (q, k, v))
    for g, p, wnt, name in zip(got, plain, want, "qkv"):
        assert_within(g, p, wnt, dtype, f"grad {name}", max(Lq, Lk), scale=want)


@pytest.mark.parametrize("dtype", [f16, bf16])
@pytest.mark.parametrize("mask", ["none", "causal+padding+float"])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_half_precision_accumulates_in_float32(dtype, mask, softcap):
    """CPU: error against a float64 reference must stay within a few units of the dtype's
    rounding: inputs and output are rounded to the dtype, everything in between is float32
    (soft-capping included)."""
    q, k, v = qkv(2, 4, 33, 47, 32, dtype=dtype, requires_grad=True)
    kwargs = MASKS[mask](2, 4, 33, 47)
    out = attn_export.attention(q, k, v, softcap=softcap, **kwargs)
    assert out.dtype == dtype
    expected, _ = reference_attention(q, k, v, softcap=softcap, **kwargs)
    assert_rel_close(out, expected, 4 * EPS[dtype], "output")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad.double())
    for g, w, name in zip(got, want, "qkv"):
        assert g.dtype == dtype
        assert_rel_close(g, w, 8 * EPS[dtype], f"grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["none", "bool_3d", "float_2d", "causal+padding+float"])
def test_gradcheck_attention_float64(mask, device):
    q, k, v = qkv(2, 2, 4, 5, 3, dtype=f64, requires_grad=True, device=device)
    kwargs = masks_in(MASKS[mask](2, 2, 4, 5, device), f64)
    assert torch.autograd.gradcheck(lambda q, k, v: attn_export.attention(q, k, v, **kwargs), (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["self", "separate"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_gradcheck_layer_float64(kind, need_weights, batch_first, device):
    E, H, L, S, B = 8, 2, 4, 3, 2
    make = lambda *s: torch.randn(*s, dtype=f64, device=device, requires_grad=True)  # noqa: E731
    w_in, b_in, w_out, b_out = make(3 * E, E), make(3 * E), make(E, E), make(E)
    shape = lambda n: (B, n, E) if batch_first else (n, B, E)  # noqa: E731
    x = make(*shape(L))
    padding = torch.tensor([[False, False, False], [False, True, True]], device=device)

    if kind == "self":
        inputs = (x, w_in, b_in, w_out, b_out)
        padding = torch.tensor([[False, False, False, True], [False, True, True, False]], device=device)

        def fn(x, w_in, b_in, w_out, b_out):
            out, w = attn_export.multi_head_attention(
                x, x, x, H, w_in, b_in, w_out, b_out, key_padding_mask=padding,
                need_weights=need_weights, batch_first=batch_first)
            return (out, w) if need_weights else out
    else:
        k, v = make(*shape(S)), make(*shape(S))
        inputs = (x, k, v, w_in, b_in, w_out, b_out)

        def fn(x, k, v, w_in, b_in, w_out, b_out):
            out, w = attn_export.multi_head_attention(
                x, k, v, H, w_in, b_in, w_out, b_out, key_padding_mask=padding,
                need_weights=need_weights, average_attn_weights=False, batch_first=batch_first)
            return (out, w) if need_weights else out

    assert torch.autograd.gradcheck(fn, inputs)


def test_double_backward_is_refused_clearly():
    q, k, v = qkv(1, 1, 3, 3, 4, dtype=f64, requires_grad=True)
    out = attn_export.attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gq.sum().backward()


def test_mask_requiring_grad_is_refused():
    q, k, v = qkv(1, 1, 3, 3, 4, requires_grad=True)
    mask = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask / key_padding_mask are not supported"):
        attn_export.attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_come_in_the_layout_of_their_inputs(device):
    # Contiguous q, k, v (leaves, as in SDPA-style code) get contiguous gradients, which autograd
    # keeps as .grad as they are: token-major ones cost AccumulateGrad a strided copy each,
    # 3 x 1.1 ms per causal forward+backward at [1, 4, 1024, 64] on one thread
    # (docs/benchmarks.md). Token-major inputs (the layer's heads, views of its projections)
    # keep token-major gradients.
    contiguous = [t.detach() for t in qkv(2, 3, 7, 5, 8, device=device)]
    token_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in contiguous]
    for inputs in (contiguous, token_major):
        out, lse, _ = ops._attention_forward(*inputs, None, None, False, None, False)
        grads = ops._attention_backward(torch.randn_like(out), None, *inputs, lse, None, None, False, None, out)
        assert [g.stride() for g in grads] == [t.stride() for t in inputs]
        # The fake kernel states the same layouts (opcheck compares strides).
        torch.library.opcheck(ops._attention_backward.default,
                              (torch.randn_like(out), None, *inputs, lse, None, None, False, None))
    leaves = [t.clone().requires_grad_() for t in contiguous]
    out = attn_export.attention(*leaves)
    with torch.profiler.profile() as prof:
        out.backward(torch.randn_like(out))
    assert [e.name for e in prof.events() if e.name == "aten::copy_"] == []


# The opcheck samples: small blocks on the CPU; head dim 64 (tensor cores) on the GPU.
OPCHECK_SIZES = {"cpu": (2, 2, 5, 4, 8), "cuda": (2, 2, 37, 29, 64)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,mask", [
    # Every dtype with every mask input at once, and with one simpler mask (four opchecks each).
    *((dtype, "causal+padding+float") for dtype in (f32, f64, bf16)),
    (f32, "bool_3d"), (f64, "none"), (bf16, "bool_3d"),
])
def test_opcheck_core_ops(dtype, mask, device):
    B, H, Lq, Lk, D = OPCHECK_SIZES[device]
    kwargs = masks_in(MASKS[mask](B, H, Lq, Lk, device), dtype)
    attn_mask, padding, is_causal = kwargs.get("attn_mask"), kwargs.get("key_padding_mask"), kwargs.get("is_causal", False)
    q, k, v = qkv(B, H, Lq, Lk, D, dtype=dtype, requires_grad=True, device=device)
    torch.library.opcheck(ops.attention.default, (q, k, v, attn_mask, padding, is_causal, None))
    detached = [t.detach() for t in (q, k, v)]
    out, lse, _ = ops._attention_forward(*detached, attn_mask, padding, is_causal, None, False)
    torch.library.opcheck(ops._attention_forward.default, (*detached, attn_mask, padding, is_causal, 0.5, True))
    torch.library.opcheck(
        ops._attention_backward.default,
        (torch.randn_like(out), None, *detached, lse, attn_mask, padding, is_causal, None),
    )
    torch.library.opcheck(  # with the forward's output: the flash backward where it applies
        ops._attention_backward.default,
        (torch.randn_like(out), None, *detached, lse, attn_mask, padding, is_causal, None, out),
    )


# (E, H, L, S, B) and opcheck's tolerances. On the CPU, eager runs the layer's own kernel; the
# AOT-traced graph (symbolic sizes) the generic implementation through the dispatcher. The two
# differ by float rounding, amplified in some gradient entries: the tolerance covers that, not
# the parity with nn.MultiheadAttention, which tests/ops/module/test_module_parity.py holds to ~1e-6.
LAYER_OPCHECK = {"cpu": ((8, 2, 5, 3, 2), dict(atol=1e-4, rtol=1e-4)), "cuda": ((64, 2, 21, 21, 2), {})}


# Each kind of call meets both layouts and both need_weights values (pairwise, not the full
# product: every case runs seven opchecks, the AOT one tracing the op with symbolic sizes).
@pytest.mark.parametrize("device,batch_first,kind,need_weights", [
    *(("cpu", bf, kind, bf == (i % 2 == 0)) for bf in (False, True)
      for i, kind in enumerate(("self", "separate", "unbatched"))),
    on_cuda("cuda", True, "self", False),
    on_cuda("cuda", True, "self", True),
])
def test_opcheck_layer_op(device, batch_first, kind, need_weights):
    (E, H, L, S, B), tolerance = LAYER_OPCHECK[device]
    make = lambda *s: torch.randn(*s, device=device, requires_grad=True)  # noqa: E731
    w_in, b_in, w_out = make(3 * E, E), make(3 * E), make(E, E)
    shape = lambda n: (B, n, E) if batch_first else (n, B, E)  # noqa: E731
    if kind == "unbatched":
        q = k = v = make(L, E)
        padding = torch.tensor([False, False, False, True, False], device=device)
    elif kind == "self":
        q = k = v = make(*shape(L))
        padding = torch.zeros(B, L, dtype=torch.bool, device=device)
        padding[1, -3:] = True
    else:
        q = make(*shape(L))
        k, v = make(*shape(S)), make(*shape(S))
        padding = torch.tensor([[False, False, True], [False, False, False]], device=device)
    torch.library.opcheck(
        ops.multi_head_attention.default,
        (q, k, v, H, w_in, b_in, w_out, None, torch.randn(L, S if kind == "separate" else L, device=device),
         padding, need_weights, True, False, batch_first),
        **tolerance,
    )
    args = (q.detach(), k.detach(), v.detach(), H, w_in.detach(), b_in.detach(), w_out.detach(), None,
            None, padding, need_weights, True, False, batch_first)
    packed = kind != "separate"
    torch.library.opcheck(ops._multi_head_attention_forward.default, (*args, packed))
    _, _, q_proj, kv_proj, attn, lse = ops._multi_head_attention_forward(*args, packed)
    grad_output = torch.randn_like(q.detach())
    for mask in ([True] * 7, [True, False, True, False, True, True, False]):
        torch.library.opcheck(
            ops._multi_head_attention_backward.default,
            (grad_output, None, *args[:8], *args[8:14], packed, False, q_proj, kv_proj, attn, lse, mask),
        )


@pytest.mark.parametrize("mask", ["none", "causal+padding+float", "bool_3d"])
def test_backward_with_and_without_the_forward_output(mask):
    """With the forward's output the CPU backward runs the flash kernels (D = rowsum(dO * O));
    without it the row kernels recompute whole probability rows. Both must give the float64
    reference gradients."""
    q, k, v = qkv(2, 3, 70, 33, 16)
    kwargs = MASKS[mask](2, 3, 70, 33)
    attn_mask, padding, causal = kwargs.get("attn_mask"), kwargs.get("key_padding_mask"), kwargs.get("is_causal", False)
    out, lse, probs = ops._attention_forward(q, k, v, attn_mask, padding, causal, None, True)
    grad = torch.randn_like(out)
    rows = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, padding, causal, None)
    flash = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, padding, causal, None, out)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected, _ = reference_attention(q64, k64, v64, **kwargs)
    want = torch.autograd.grad(expected, (q64, k64, v64), grad.double())
    for a, b, w, name in zip(rows, flash, want, "qkv"):
        assert_rel_close(a, w, 5e-6, f"row-kernel grad {name}")
        assert_rel_close(b, w, 5e-6, f"flash grad {name}")


# --------------------------------------------------------------------------------------------
# Logit soft-capping (Gemma 2, Grok): cap(x) = softcap * tanh(x / softcap) of the scaled score,
# before the masks. The reference (helpers.reference_attention) writes it in float64 torch ops.
# --------------------------------------------------------------------------------------------

# 30 and 50: Gemma 2's / Grok's values (barely capped at these sizes); 2: the unit-normal scores
# are already capped; 0.5: tanh is saturated for most scores (see also the large-score test).
SOFTCAPS = [0.5, 2.0, 30.0]
# The tiled size is slow-tier: the tiled kernel without soft-capping runs in the fast tier above.
SOFTCAP_SIZES = [(5, 7, 8), (1, 9, 8), (66, 40, 8), pytest.param(257, 530, 32, marks=pytest.mark.slow)]


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("seqlen_q,seqlen_k,D", SOFTCAP_SIZES)
def test_softcap_forward_and_backward_match_float64_reference(mask, softcap, seqlen_q, seqlen_k, D):
    B, H = 2, 3
    check_core("cpu", f32, B, H, seqlen_q, seqlen_k, D, MASKS[mask](B, H, seqlen_q, seqlen_k), softcap=softcap)


@pytest.mark.parametrize("device,dtype", [("cpu", f32), *(on_cuda("cuda", dt, ) for dt in (f16, bf16, f32))])
@pytest.mark.parametrize("mask", ["none", "causal+padding+float", "bool_3d"])
def test_softcap_saturates_large_scores(device, dtype, mask):
    """Scores of magnitude ~10-40 against softcap 2: tanh is flat (1 - t^2 down to ~1e-17), the
    probabilities are those of the capped scores, and the gradients are small but exact."""
    B, H, Lq, Lk, D = 2, 2, 37, 29, 64
    masks = MASKS[mask](B, H, Lq, Lk, device)
    q, k, v = qkv(B, H, Lq, Lk, D, dtype, requires_grad=True, device=device)
    out = attn_export.attention(q, k, v, scale=1.0, softcap=2.0, **masks)
    exact, _ = reference_attention(q, k, v, scale=1.0, softcap=2.0, **masks)
    raw = (q.double() @ k.double().transpose(-1, -2)).abs()
    assert raw.max() > 20  # the test's premise: most scores are far beyond the cap
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    if device == "cpu":
        assert_rel_close(out, exact, 2e-6, "output")
        for g, w, name in zip(got, want, "qkv"):
            assert_rel_close(g, w, 5e-6, f"grad {name}")
    else:
        plain, _ = reference_attention(q, k, v, scale=1.0, softcap=2.0, dtype=dtype, **masks)
        assert_within(out, plain, exact, dtype, "output", D)
        plain_grads = torch.autograd.grad(plain, (q, k, v), grad)
        for g, p, w, name in zip(got, plain_grads, want, "qkv"):
            assert_within(g, p, w, dtype, f"grad {name}", D, scale=want)


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_fully_masked_rows_give_zeros_and_finite_gradients(device):
    B, H, Lq, Lk, D, row = 2, 2, 4, 3, 8, 2
    q, k, v = qkv(B, H, Lq, Lk, D, requires_grad=True, device=device)
    mask = torch.zeros(Lq, Lk, dtype=torch.bool, device=device)
    mask[row] = True
    padding = torch.zeros(B, Lk, device=device)
    padding[1] = -math.inf                                # batch 1 sees nothing at all (additive -inf)
    out = attn_export.attention(q, k, v, attn_mask=mask, key_padding_mask=padding, softcap=1.0)
    assert torch.equal(out[:, :, row], torch.zeros_like(out[:, :, row]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][1], torch.zeros_like(grads[0][1]))
    expected, _ = reference_attention(q, k, v, attn_mask=mask, key_padding_mask=padding, softcap=1.0)
    assert_rel_close(out, expected, 2e-6 if device == "cpu" else 1e-5, "output")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [0.7, 5.0])
@pytest.mark.parametrize("mask", ["none", "bool_3d", "float_2d", "causal+padding+float"])
def test_gradcheck_softcap_float64(mask, softcap, device):
    q, k, v = qkv(2, 2, 4, 5, 3, dtype=f64, requires_grad=True, device=device)
    kwargs = masks_in(MASKS[mask](2, 2, 4, 5, device), f64)
    assert torch.autograd.gradcheck(
        lambda q, k, v: attn_export.attention(q, k, v, scale=2.0, softcap=softcap, **kwargs), (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
def test_softcap_zero_or_none_is_exactly_no_softcap(device):
    q, k, v = qkv(2, 3, 9, 11, 8, requires_grad=True, device=device)
    masks = MASKS["causal+padding+float"](2, 3, 9, 11, device)
    plain = attn_export.attention(q, k, v, **masks)
    grad = torch.randn_like(plain)
    plain_grads = torch.autograd.grad(plain, (q, k, v), grad)
    for softcap in (None, 0, 0.0):
        out = attn_export.attention(q, k, v, softcap=softcap, **masks)
        assert torch.equal(out, plain)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), plain_grads))
    explicit = ops.attention(q, k, v, masks["attn_mask"], masks["key_padding_mask"], True, None, 0.0)
    assert torch.equal(explicit, plain)


@pytest.mark.parametrize("bad", [-1.0, -1e-30, -3, math.nan, math.inf, -math.inf])
def test_bad_softcap_is_refused_clearly(bad):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        attn_export.attention(q, k, v, softcap=bad)


@pytest.mark.parametrize("bad", ["2", True, torch.tensor(2.0)])
def test_softcap_of_another_type_is_refused(bad):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="softcap must be a real number"):
        attn_export.attention(q, k, v, softcap=bad)


@pytest.mark.parametrize("bad", [-2.0, math.nan, math.inf])
def test_operators_refuse_a_bad_softcap(bad):
    """The operators check too (callers of torch.ops bypass the Python wrapper), and so do the
    fake kernels (tests/ops/core/test_fake.py), with the same words."""
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        ops.attention(q, k, v, None, None, False, None, bad)
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        ops._attention_forward(q, k, v, None, None, False, None, False, bad)
    out, lse, _ = ops._attention_forward(q, k, v, None, None, False, None, False)
    with pytest.raises(RuntimeError, match="softcap must be finite and >= 0"):
        ops._attention_backward(out, None, q, k, v, lse, None, None, False, None, None, bad)


def test_softcap_weights_and_both_backward_kernels():
    """need_weights returns the capped probabilities; both CPU backward kernels (the row kernels
    without the forward's output, the flash kernels with it) recompute the raw scores for the
    cap's derivative and agree with float64."""
    B, H, Lq, Lk = 2, 3, 70, 33
    kwargs = MASKS["causal+padding+float"](B, H, Lq, Lk)
    attn_mask, padding = kwargs["attn_mask"], kwargs["key_padding_mask"]
    q, k, v = qkv(B, H, Lq, Lk, 16)
    out, lse, probs = ops._attention_forward(q, k, v, attn_mask, padding, True, 0.5, True, 1.25)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected, expected_p = reference_attention(q64, k64, v64, scale=0.5, softcap=1.25, **kwargs)
    assert_rel_close(out, expected, 2e-6, "output")
    assert_rel_close(probs, expected_p, 2e-6, "weights")
    grad = torch.randn_like(out)
    want = torch.autograd.grad(expected, (q64, k64, v64), grad.double())
    rows = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, padding, True, 0.5, None, 1.25)
    flash = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, padding, True, 0.5, out, 1.25)
    for a, b, w, name in zip(rows, flash, want, "qkv"):
        assert_rel_close(a, w, 5e-6, f"row-kernel grad {name}")
        assert_rel_close(b, w, 5e-6, f"flash grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["none", "causal+padding+float"])
def test_opcheck_core_ops_with_softcap(mask, device):
    B, H, Lq, Lk, D = OPCHECK_SIZES[device]
    kwargs = MASKS[mask](B, H, Lq, Lk, device)
    attn_mask, padding, is_causal = kwargs.get("attn_mask"), kwargs.get("key_padding_mask"), kwargs.get("is_causal", False)
    q, k, v = qkv(B, H, Lq, Lk, D, requires_grad=True, device=device)
    torch.library.opcheck(ops.attention.default, (q, k, v, attn_mask, padding, is_causal, None, 3.0))
    detached = [t.detach() for t in (q, k, v)]
    out, lse, _ = ops._attention_forward(*detached, attn_mask, padding, is_causal, None, False, 3.0)
    torch.library.opcheck(ops._attention_forward.default, (*detached, attn_mask, padding, is_causal, 0.5, True, 3.0))
    torch.library.opcheck(
        ops._attention_backward.default,
        (torch.randn_like(out), None, *detached, lse, attn_mask, padding, is_causal, None, None, 3.0),
    )
