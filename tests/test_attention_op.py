"""The attention core operator (attn_export.attention) against a float64 reference written
from the definition, plus float64 gradcheck and torch.library.opcheck for every operator."""
import math

import pytest
import torch

import attn_export
from helpers import EPS, assert_rel_close, reference_attention

ops = torch.ops.attn_export


def _qkv(batch=2, heads=3, seqlen_q=5, seqlen_k=7, dim=8, dim_v=None, dtype=torch.float32, requires_grad=False):
    dim_v = dim if dim_v is None else dim_v
    make = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    return make(batch, heads, seqlen_q, dim), make(batch, heads, seqlen_k, dim), make(batch, heads, seqlen_k, dim_v)


def _padding(batch, seqlen_k, dtype=torch.bool):
    m = torch.zeros(batch, seqlen_k, dtype=torch.bool)
    for b in range(batch):
        m[b, seqlen_k - b - 1 :] = b > 0
    return m if dtype == torch.bool else torch.zeros(batch, seqlen_k, dtype=dtype).masked_fill(m, -math.inf)


MASKS = {
    "none": lambda B, H, Lq, Lk: {},
    "bool_2d": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(Lq, Lk) < 0.4},
    "float_2d": lambda B, H, Lq, Lk: {"attn_mask": torch.randn(Lq, Lk)},
    "bool_3d": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(B * H, Lq, Lk) < 0.4},
    "float_4d_broadcast_heads": lambda B, H, Lq, Lk: {"attn_mask": torch.randn(B, 1, Lq, Lk)},
    "bool_4d_full": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(B, H, Lq, Lk) < 0.4},
    "padding_bool": lambda B, H, Lq, Lk: {"key_padding_mask": _padding(B, Lk)},
    "padding_float": lambda B, H, Lq, Lk: {"key_padding_mask": _padding(B, Lk, torch.float32)},
    "causal": lambda B, H, Lq, Lk: {"is_causal": True},
    "causal+padding+float": lambda B, H, Lq, Lk: {
        "is_causal": True, "key_padding_mask": _padding(B, Lk), "attn_mask": torch.randn(Lq, Lk)},
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("seqlen_q,seqlen_k,D", [(5, 7, 8), (7, 5, 8), (1, 1, 8), (1, 9, 8), (66, 40, 8), (257, 530, 32), (300, 1100, 16)])
def test_forward_and_backward_match_float64_reference(mask, seqlen_q, seqlen_k, D):
    # 257 x 530 x 32 and 300 x 1100 x 16: float32 blocks above 64^3 multiply-adds, which run on
    # the tiled kernel of csrc/ops/cpu/linear_kernel.cpp on AVX-512 CPUs (BLAS elsewhere); the
    # latter in two query blocks, so that dK and dV accumulate across blocks. The rest: the
    # small-block loops.
    B, H = 2, 3
    q, k, v = _qkv(B, H, seqlen_q, seqlen_k, D, requires_grad=True)
    kwargs = MASKS[mask](B, H, seqlen_q, seqlen_k)
    out = attn_export.attention(q, k, v, **kwargs)
    expected, _ = reference_attention(q, k, v, **kwargs)
    assert out.shape == (B, H, seqlen_q, D)
    assert_rel_close(out, expected, 2e-6, "output")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad.double())
    for g, w, name in zip(got, want, "qkv"):
        assert_rel_close(g, w, 5e-6, f"grad {name}")


def test_head_dim_v_differs_and_explicit_scale():
    q, k, v = _qkv(dim=8, dim_v=5, requires_grad=True)
    out = attn_export.attention(q, k, v, scale=0.3)
    expected, _ = reference_attention(q, k, v, scale=0.3)
    assert out.shape == (2, 3, 5, 5)
    assert_rel_close(out, expected, 2e-6, "output")


def test_boolean_mask_true_means_masked_out():
    q, k, v = _qkv(1, 1, 1, 2, 4)
    out = attn_export.attention(q, k, v, attn_mask=torch.tensor([[False, True]]))
    torch.testing.assert_close(out, v[:, :, :1], rtol=0, atol=0)  # only key 0 is visible


def test_causal_is_top_left_aligned():
    q, k, v = _qkv(1, 1, 3, 5, 4)
    out = attn_export.attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0], rtol=0, atol=0)  # query 0 sees key 0 only


def test_fully_masked_rows_give_zeros_and_finite_gradients():
    q, k, v = _qkv(2, 2, 4, 3, 8, requires_grad=True)
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[2] = True
    padding = torch.tensor([[False, False, False], [True, True, True]])  # batch 1 sees nothing
    out = attn_export.attention(q, k, v, attn_mask=mask, key_padding_mask=padding)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    float_mask = torch.zeros(4, 3).masked_fill(mask, -math.inf)
    out_f = attn_export.attention(q, k, v, attn_mask=float_mask)
    assert torch.equal(out_f[:, :, 2], torch.zeros_like(out_f[:, :, 2]))
    grads = torch.autograd.grad((out.sum() + out_f.sum()), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    expected, _ = reference_attention(q, k, v, attn_mask=mask, key_padding_mask=padding)
    assert_rel_close(out, expected, 2e-6, "output")


def test_weights_and_lse_from_internal_forward():
    q, k, v = _qkv(2, 2, 6, 5, 4)
    out, lse, weights = ops._attention_forward(q, k, v, None, _padding(2, 5), False, None, True)
    expected_out, expected_p = reference_attention(q, k, v, key_padding_mask=_padding(2, 5))
    assert_rel_close(weights, expected_p, 2e-6, "weights")
    s = torch.einsum("bhid,bhjd->bhij", q.double(), k.double()) / 2.0
    s = s.masked_fill(_padding(2, 5)[:, None, None, :], -math.inf)
    assert_rel_close(lse, torch.logsumexp(s, -1), 2e-6, "logsumexp")
    _, _, no_weights = ops._attention_forward(q, k, v, None, None, False, None, False)
    assert no_weights.numel() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal+padding+float"])
def test_half_precision_accumulates_in_float32(dtype, mask):
    """Error against a float64 reference must stay within a few units of the dtype's rounding:
    inputs and output are rounded to the dtype, everything in between is float32."""
    q, k, v = _qkv(2, 4, 33, 47, 32, dtype=dtype, requires_grad=True)
    kwargs = MASKS[mask](2, 4, 33, 47)
    out = attn_export.attention(q, k, v, **kwargs)
    assert out.dtype == dtype
    expected, _ = reference_attention(q, k, v, **kwargs)
    assert_rel_close(out, expected, 4 * EPS[dtype], "output")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad.double())
    for g, w, name in zip(got, want, "qkv"):
        assert g.dtype == dtype
        assert_rel_close(g, w, 8 * EPS[dtype], f"grad {name}")


@pytest.mark.parametrize("mask", ["none", "bool_3d", "float_2d", "causal+padding+float"])
def test_gradcheck_attention_float64(mask):
    q, k, v = _qkv(2, 2, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    kwargs = {
        key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
        for key, val in MASKS[mask](2, 2, 4, 5).items()
    }
    assert torch.autograd.gradcheck(lambda q, k, v: attn_export.attention(q, k, v, **kwargs), (q, k, v))


@pytest.mark.parametrize("kind", ["self", "separate"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_gradcheck_layer_float64(kind, need_weights, batch_first):
    E, H, L, S, B = 8, 2, 4, 3, 2
    w_in = torch.randn(3 * E, E, dtype=torch.float64, requires_grad=True)
    b_in = torch.randn(3 * E, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(E, E, dtype=torch.float64, requires_grad=True)
    b_out = torch.randn(E, dtype=torch.float64, requires_grad=True)
    shape = lambda n: (B, n, E) if batch_first else (n, B, E)  # noqa: E731
    x = torch.randn(*shape(L), dtype=torch.float64, requires_grad=True)
    padding = torch.tensor([[False, False, False], [False, True, True]])

    if kind == "self":
        inputs = (x, w_in, b_in, w_out, b_out)
        padding = torch.tensor([[False, False, False, True], [False, True, True, False]])

        def fn(x, w_in, b_in, w_out, b_out):
            out, w = attn_export.multi_head_attention(
                x, x, x, H, w_in, b_in, w_out, b_out, key_padding_mask=padding,
                need_weights=need_weights, batch_first=batch_first)
            return (out, w) if need_weights else out
    else:
        k = torch.randn(*shape(S), dtype=torch.float64, requires_grad=True)
        v = torch.randn(*shape(S), dtype=torch.float64, requires_grad=True)
        inputs = (x, k, v, w_in, b_in, w_out, b_out)

        def fn(x, k, v, w_in, b_in, w_out, b_out):
            out, w = attn_export.multi_head_attention(
                x, k, v, H, w_in, b_in, w_out, b_out, key_padding_mask=padding,
                need_weights=need_weights, average_attn_weights=False, batch_first=batch_first)
            return (out, w) if need_weights else out

    assert torch.autograd.gradcheck(fn, inputs)


def test_double_backward_is_refused_clearly():
    q, k, v = _qkv(1, 1, 3, 3, 4, dtype=torch.float64, requires_grad=True)
    out = attn_export.attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gq.sum().backward()


def test_mask_requiring_grad_is_refused():
    q, k, v = _qkv(1, 1, 3, 3, 4, requires_grad=True)
    mask = torch.randn(3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask / key_padding_mask are not supported"):
        attn_export.attention(q, k, v, attn_mask=mask)


def _opcheck_samples():
    B, H, Lq, Lk, D = 2, 2, 5, 4, 8
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for kwargs in (MASKS["none"](B, H, Lq, Lk), MASKS["causal+padding+float"](B, H, Lq, Lk), MASKS["bool_3d"](B, H, Lq, Lk)):
            kwargs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kwargs.items()}
            yield dtype, kwargs


@pytest.mark.parametrize("dtype,kwargs", list(_opcheck_samples()))
def test_opcheck_core_ops(dtype, kwargs):
    q, k, v = _qkv(2, 2, 5, 4, 8, dtype=dtype, requires_grad=True)
    attn_mask, padding = kwargs.get("attn_mask"), kwargs.get("key_padding_mask")
    is_causal = kwargs.get("is_causal", False)
    torch.library.opcheck(ops.attention.default, (q, k, v, attn_mask, padding, is_causal, None))
    detached = [t.detach() for t in (q, k, v)]
    out, lse, _ = ops._attention_forward(*detached, attn_mask, padding, is_causal, None, False)
    torch.library.opcheck(ops._attention_forward.default, (*detached, attn_mask, padding, is_causal, 0.5, True))
    torch.library.opcheck(
        ops._attention_backward.default,
        (torch.randn_like(out), None, *detached, lse, attn_mask, padding, is_causal, None),
    )
    _, _, probs = ops._attention_forward(*detached, attn_mask, padding, is_causal, None, True)
    torch.library.opcheck(
        ops._attention_backward.default,
        (torch.randn_like(out), None, *detached, lse, attn_mask, padding, is_causal, None,
         probs.to(lse.dtype)),
    )


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("kind", ["self", "separate", "unbatched"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_opcheck_layer_op(batch_first, kind, need_weights):
    E, H, L, S, B = 8, 2, 5, 3, 2
    w_in = torch.randn(3 * E, E, requires_grad=True)
    b_in = torch.randn(3 * E, requires_grad=True)
    w_out = torch.randn(E, E, requires_grad=True)
    shape = lambda n: (B, n, E) if batch_first else (n, B, E)  # noqa: E731
    if kind == "unbatched":
        q = k = v = torch.randn(L, E, requires_grad=True)
        padding = torch.tensor([False, False, False, True, False])
    elif kind == "self":
        q = k = v = torch.randn(*shape(L), requires_grad=True)
        padding = torch.zeros(B, L, dtype=torch.bool)
    else:
        q = torch.randn(*shape(L), requires_grad=True)
        k, v = torch.randn(*shape(S), requires_grad=True), torch.randn(*shape(S), requires_grad=True)
        padding = torch.tensor([[False, False, True], [False, False, False]])
    # Eager keeps the forward's probabilities for the backward; the AOT-traced graph (symbolic
    # sizes) recomputes them from q, k and the log-sum-exp. The two differ by float rounding,
    # amplified in some gradient entries: the tolerance covers that, not the parity with
    # nn.MultiheadAttention, which tests/test_module_parity.py holds to ~1e-6.
    torch.library.opcheck(
        ops.multi_head_attention.default,
        (q, k, v, H, w_in, b_in, w_out, None, torch.randn(L, S if kind == "separate" else L),
         padding, need_weights, True, False, batch_first),
        atol=1e-4, rtol=1e-4,
    )
    args = (q.detach(), k.detach(), v.detach(), H, w_in.detach(), b_in.detach(), w_out.detach(), None,
            None, padding, need_weights, True, False, batch_first)
    packed = kind != "separate"
    for save_probs in (False, True):
        torch.library.opcheck(ops._multi_head_attention_forward.default, (*args, packed, save_probs))
        _, _, q_proj, kv_proj, attn, lse, probs = ops._multi_head_attention_forward(*args, packed, save_probs)
        grad_output = torch.randn_like(q.detach())
        for mask in ([True] * 7, [True, False, True, False, True, True, False]):
            torch.library.opcheck(
                ops._multi_head_attention_backward.default,
                (grad_output, None, *args[:8], *args[8:14], packed, False, q_proj, kv_proj, attn, lse,
                 probs, mask),
            )


@pytest.mark.parametrize("mask", ["none", "causal+padding+float", "bool_3d"])
def test_backward_from_saved_probabilities_equals_recomputation(mask):
    """The layer's backward reads the forward's probabilities when they fit in memory; the
    core recomputes them. Both must give the float64 reference gradients."""
    q, k, v = _qkv(2, 3, 70, 33, 16)
    kwargs = MASKS[mask](2, 3, 70, 33)
    attn_mask, padding, causal = kwargs.get("attn_mask"), kwargs.get("key_padding_mask"), kwargs.get("is_causal", False)
    out, lse, probs = ops._attention_forward(q, k, v, attn_mask, padding, causal, None, True)
    grad = torch.randn_like(out)
    recomputed = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, padding, causal, None)
    from_probs = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, padding, causal, None, probs)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected, _ = reference_attention(q64, k64, v64, **kwargs)
    want = torch.autograd.grad(expected, (q64, k64, v64), grad.double())
    for a, b, w, name in zip(recomputed, from_probs, want, "qkv"):
        assert_rel_close(a, w, 5e-6, f"recomputed grad {name}")
        assert_rel_close(b, w, 5e-6, f"saved-probs grad {name}")
