"""The CUDA operators on a GPU: parity with float64 references, with nn.MultiheadAttention and
with the CPU operator; every mask kind; fully masked rows; sequence lengths 1..4096; head dims
32/64/128 (tensor cores) and 40 (generic kernels); float64 gradcheck; opcheck.

Every test carries the `cuda` marker and is skipped without a GPU (conftest.py). On a GPU,
scripts/gpu_check.sh builds the extension for the device and runs this file.

Tolerances are derived, FlashAttention style: the fused result's error against a float64
reference may be at most twice the error of the same computation done the plain way in the
same dtype (matmul, softmax, matmul; or the stock nn.MultiheadAttention), plus a slack of the
dtype's rounding: one eps for float16/bfloat16, eps * sqrt(n) over the longest reduction for
float32/float64, whose errors are summation-order noise (see assert_within).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attn_export
from attn_export import FusedMultiheadAttention

pytestmark = pytest.mark.cuda

ops = torch.ops.attn_export
DEVICE = "cuda"
EPS = {dt: torch.finfo(dt).eps for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
HALF_TYPES = (torch.float16, torch.bfloat16)


def _require_cuda_kernels():
    if not torch._C._dispatch_has_kernel_for_dispatch_key("attn_export::attention", "CUDA"):
        raise RuntimeError(
            "attn_export was built without its CUDA kernels; rebuild with ATTN_EXPORT_CUDA=1 "
            "(scripts/gpu_check.sh does)"
        )


def _err(actual, expected):
    """max |a - e| relative to max |e| (absolute when the reference is all zeros)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1.0 if expected.abs().max() == 0 else 1e-30)
    return float((actual - expected).abs().max() / scale)


def assert_within(fused, plain, exact, dtype, what, n=1, factor=2.0):
    """Error of `fused` against `exact` at most `factor` x that of `plain`, plus a slack: one eps
    for float16/bfloat16 (whose error is dominated by roundings the plain computation shares),
    eps * sqrt(n) for float32/float64, whose tiny errors come from the order of summation over
    the longest reduction (n terms), which no two implementations share."""
    assert fused.shape == exact.shape, f"{what}: shape {tuple(fused.shape)} != {tuple(exact.shape)}"
    assert torch.isfinite(fused).all(), f"{what}: non-finite values"
    slack = EPS[dtype] * (1.0 if dtype in HALF_TYPES else math.sqrt(n))
    err, bound = _err(fused, exact), factor * _err(plain, exact) + slack
    assert err <= bound, f"{what}: error {err:.2e} > bound {bound:.2e} ({factor}x the plain {dtype} computation's + {slack:.1e})"


# ---- References -----------------------------------------------------------------------------

def _bias(masks, B, H, Lq, Lk, dtype, device):
    bias = torch.zeros(B, H, Lq, Lk, dtype=dtype, device=device)
    m = masks.get("attn_mask")
    if m is not None:
        if m.dim() == 3:
            m = m.reshape(-1, H, Lq, Lk) if m.shape[0] != 1 else m.unsqueeze(0)
        bias = bias + (torch.zeros_like(m, dtype=dtype).masked_fill(m, -math.inf) if m.dtype == torch.bool else m.to(dtype))
    m = masks.get("key_padding_mask")
    if m is not None:
        m = m[:, None, None, :]
        bias = bias + (torch.zeros_like(m, dtype=dtype).masked_fill(m, -math.inf) if m.dtype == torch.bool else m.to(dtype))
    if masks.get("is_causal"):
        bias = bias.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool, device=device).triu(1), -math.inf)
    return bias


def reference(q, k, v, dtype=torch.float64, scale=None, **masks):
    """softmax(scale q k^T + masks) v computed the plain way in `dtype` (float64: the exact
    reference; the inputs' dtype: the plain same-precision computation). Rows without a
    visible key give zeros, as the fused operator's do."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale + _bias(masks, B, H, Lq, Lk, dtype, q.device)
    visible = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~visible, 0.0), dim=-1) * visible
    return p @ v, p


def _qkv(B, H, Lq, Lk, D, dtype, Dv=None, requires_grad=False):
    Dv = D if Dv is None else Dv
    make = lambda *s: torch.randn(*s, dtype=dtype, device=DEVICE, requires_grad=requires_grad)  # noqa: E731
    return make(B, H, Lq, D), make(B, H, Lk, D), make(B, H, Lk, Dv)


def _padding(B, Lk, dtype=torch.bool):
    m = torch.zeros(B, Lk, dtype=torch.bool, device=DEVICE)
    for b in range(B):
        m[b, Lk - 3 * b - 1:] = b > 0
    return m if dtype == torch.bool else torch.zeros(B, Lk, dtype=dtype, device=DEVICE).masked_fill(m, -math.inf)


MASKS = {
    "none": lambda B, H, Lq, Lk: {},
    "causal": lambda B, H, Lq, Lk: {"is_causal": True},
    "bool_2d": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(Lq, Lk, device=DEVICE) < 0.4},
    "float_2d": lambda B, H, Lq, Lk: {"attn_mask": torch.randn(Lq, Lk, device=DEVICE)},
    "bool_3d": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(B * H, Lq, Lk, device=DEVICE) < 0.4},
    "float_4d_broadcast_heads": lambda B, H, Lq, Lk: {"attn_mask": torch.randn(B, 1, Lq, Lk, device=DEVICE)},
    "bool_4d_full": lambda B, H, Lq, Lk: {"attn_mask": torch.rand(B, H, Lq, Lk, device=DEVICE) < 0.4},
    "padding_bool": lambda B, H, Lq, Lk: {"key_padding_mask": _padding(B, Lk)},
    "padding_float": lambda B, H, Lq, Lk: {"key_padding_mask": _padding(B, Lk, torch.float32)},
    "causal+padding+float": lambda B, H, Lq, Lk: {
        "is_causal": True, "key_padding_mask": _padding(B, Lk), "attn_mask": torch.randn(Lq, Lk, device=DEVICE)},
}


def _core_check(B, H, Lq, Lk, D, dtype, masks, Dv=None, backward=True):
    """Fused core vs float64 reference, bounded by the plain same-dtype computation's error."""
    _require_cuda_kernels()
    q, k, v = _qkv(B, H, Lq, Lk, D, dtype, Dv, requires_grad=True)
    out = attn_export.attention(q, k, v, **masks)
    exact, _ = reference(q, k, v, torch.float64, **masks)
    plain, _ = reference(q, k, v, dtype, **masks)
    assert out.dtype == dtype and out.device == q.device
    n = max(Lq, Lk, D)
    assert_within(out, plain, exact, dtype, "output", n)
    if not backward:
        return
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    plain_grads = torch.autograd.grad(plain, (q, k, v), grad)
    for g, p, w, name in zip(got, plain_grads, want, "qkv"):
        assert g.dtype == dtype
        assert_within(g, p, w, dtype, f"grad {name}", n)


# ---- The attention core ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 40])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen", [1, 7, 97, 128, 1025])
def test_core_matches_reference(dtype, head_dim, causal, seqlen):
    _core_check(2, 3, seqlen, seqlen, head_dim, dtype, {"is_causal": causal})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_core_long_sequence(dtype, head_dim):
    _core_check(1, 2, 4096, 4096, head_dim, dtype, {"is_causal": True})
    _core_check(1, 2, 4096, 4096, head_dim, dtype, {}, backward=False)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 4096), (97, 1025), (1025, 97), (4096, 1)])
def test_core_unequal_lengths(seqlen_q, seqlen_k):
    for causal in (False, True):
        _core_check(1, 2, seqlen_q, seqlen_k, 64, torch.float16, {"is_causal": causal})


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mask", list(MASKS))
def test_core_every_mask(dtype, mask):
    B, H, Lq, Lk = 2, 3, 77, 131
    _core_check(B, H, Lq, Lk, 64, dtype, MASKS[mask](B, H, Lq, Lk))


def test_core_head_dim_v_differs():
    _core_check(2, 2, 33, 47, 64, torch.float16, {"is_causal": True}, Dv=32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fully_masked_rows_give_zeros_and_finite_gradients(dtype):
    _require_cuda_kernels()
    B, H, Lq, Lk = 2, 2, 70, 90
    q, k, v = _qkv(B, H, Lq, Lk, 64, dtype, requires_grad=True)
    mask = torch.zeros(Lq, Lk, dtype=torch.bool, device=DEVICE)
    mask[5] = True
    padding = torch.zeros(B, Lk, dtype=torch.bool, device=DEVICE)
    padding[1] = True
    out = attn_export.attention(q, k, v, attn_mask=mask, key_padding_mask=padding)
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    float_mask = torch.zeros(Lq, Lk, device=DEVICE).masked_fill(mask, -math.inf)
    out_f = attn_export.attention(q, k, v, attn_mask=float_mask)
    assert torch.equal(out_f[:, :, 5], torch.zeros_like(out_f[:, :, 5]))
    dq, dk, dv = torch.autograd.grad(out.sum() + out_f.sum(), (q, k, v), retain_graph=True)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    dq1, dk1, dv1 = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(dq1[1], torch.zeros_like(dq1[1])) and torch.equal(dk1[1], torch.zeros_like(dk1[1]))
    _, lse, _ = ops._attention_forward(q.detach(), k.detach(), v.detach(), mask, padding, False, None, False)
    assert torch.isneginf(lse[:, :, 5]).all() and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_outputs_have_the_fake_kernels_layouts(dtype):
    """Strides and dtypes of every result are exactly those the fake kernels promise."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _require_cuda_kernels()
    q, k, v = _qkv(2, 3, 17, 19, 64, dtype)
    real = ops._attention_forward(q, k, v, None, _padding(2, 19), True, None, True)
    grads = ops._attention_backward(torch.randn_like(real[0]), None, q, k, v, real[1], None, None, True, None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = ops._attention_forward(q, k, v, None, _padding(2, 19), True, None, True)
        fake_grads = ops._attention_backward(torch.randn_like(real[0]), None, q, k, v, real[1], None, None, True, None)
    for r, f in zip((*real, *grads), (*fake, *fake_grads)):
        assert (r.shape, r.stride(), r.dtype, r.device) == (f.shape, f.stride(), f.dtype, f.device)
    assert real[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_weights_and_their_gradient(dtype):
    """need_weights (the unfused path) and a gradient flowing into the weights."""
    _require_cuda_kernels()
    B, H, Lq, Lk = 2, 2, 45, 67
    masks = MASKS["causal+padding+float"](B, H, Lq, Lk)
    q, k, v = _qkv(B, H, Lq, Lk, 64, dtype, requires_grad=True)
    o, lse, w = ops._attention_forward(q, k, v, masks["attn_mask"], masks["key_padding_mask"], True, None, True)
    exact_o, exact_w = reference(q, k, v, torch.float64, **masks)
    plain_o, plain_w = reference(q, k, v, dtype, **masks)
    assert w.dtype == dtype and w.is_contiguous()
    assert_within(w, plain_w, exact_w, dtype, "weights", Lk)
    go, gw = torch.randn_like(o), torch.randn(B, H, Lq, Lk, device=DEVICE)
    got = ops._attention_backward(go, gw, q, k, v, lse, masks["attn_mask"], masks["key_padding_mask"], True, None)
    loss = (exact_o * go.double()).sum() + (exact_w * gw.double()).sum()
    want = torch.autograd.grad(loss, (q, k, v))
    plain = torch.autograd.grad((plain_o * go).sum() + (plain_w * gw.to(dtype)).sum(), (q, k, v))
    for g, p, wnt, name in zip(got, plain, want, "qkv"):
        assert_within(g, p, wnt, dtype, f"grad {name}", max(Lq, Lk))


def test_non_contiguous_inputs_and_a_side_stream():
    """Heads split from a packed [B, L, 3, H, D] projection (strided views), on a side stream."""
    _require_cuda_kernels()
    B, L, H, D = 2, 50, 4, 64
    qkv = torch.randn(B, L, 3, H, D, dtype=torch.float16, device=DEVICE)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = attn_export.attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    exact, _ = reference(q, k, v, torch.float64, is_causal=True)
    plain, _ = reference(q, k, v, torch.float16, is_causal=True)
    assert_within(out, plain, exact, torch.float16, "output", L)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_matches_the_cpu_operator(dtype):
    _require_cuda_kernels()
    B, H, Lq, Lk = 2, 3, 41, 29
    masks = MASKS["causal+padding+float"](B, H, Lq, Lk)
    q, k, v = _qkv(B, H, Lq, Lk, 64, dtype, requires_grad=True)
    cpu = [t.detach().cpu().requires_grad_() for t in (q, k, v)]
    cpu_masks = {n: (m.cpu() if isinstance(m, torch.Tensor) else m) for n, m in masks.items()}
    out, out_cpu = attn_export.attention(q, k, v, **masks), attn_export.attention(*cpu, **cpu_masks)
    exact, _ = reference(q, k, v, torch.float64, **masks)
    # The CPU op computes in float32 and rounds once; the GPU op's error must stay within 2x
    # of the plain same-dtype computation, as everywhere; and for float32 the two agree closely.
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), out_cpu, rtol=1e-5, atol=1e-5)
    else:
        assert_within(out, reference(q, k, v, dtype, **masks)[0], exact, dtype, "output", Lk)
        assert _err(out_cpu, exact.cpu()) <= EPS[dtype]
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    got_cpu = torch.autograd.grad(out_cpu, cpu, grad.cpu())
    for g, c, name in zip(got, got_cpu, "qkv"):
        assert g.shape == c.shape and g.stride() == c.stride(), name
        if dtype == torch.float32:
            torch.testing.assert_close(g.cpu(), c, rtol=1e-4, atol=1e-4, msg=f"grad {name}")


# ---- float64 gradcheck (generic kernels) ------------------------------------------------------

@pytest.mark.parametrize("mask", ["none", "bool_3d", "float_2d", "causal+padding+float"])
def test_gradcheck_attention_float64(mask):
    _require_cuda_kernels()
    q, k, v = _qkv(2, 2, 4, 5, 3, torch.float64, requires_grad=True)
    kwargs = {n: (m.double() if isinstance(m, torch.Tensor) and m.is_floating_point() else m)
              for n, m in MASKS[mask](2, 2, 4, 5).items()}
    assert torch.autograd.gradcheck(lambda q, k, v: attn_export.attention(q, k, v, **kwargs), (q, k, v))


@pytest.mark.parametrize("need_weights", [False, True])
def test_gradcheck_layer_float64(need_weights):
    _require_cuda_kernels()
    E, H, L, B = 8, 2, 4, 2
    make = lambda *s: torch.randn(*s, dtype=torch.float64, device=DEVICE, requires_grad=True)  # noqa: E731
    x, w_in, b_in, w_out, b_out = make(B, L, E), make(3 * E, E), make(3 * E), make(E, E), make(E)
    padding = torch.tensor([[False, False, False, True], [False, True, True, False]], device=DEVICE)

    def fn(x, w_in, b_in, w_out, b_out):
        out, w = attn_export.multi_head_attention(
            x, x, x, H, w_in, b_in, w_out, b_out, key_padding_mask=padding, need_weights=need_weights,
            batch_first=True)
        return (out, w) if need_weights else out

    assert torch.autograd.gradcheck(fn, (x, w_in, b_in, w_out, b_out))


# ---- The layer against nn.MultiheadAttention ------------------------------------------------

def _module_pair(embed, heads, dtype):
    ref = nn.MultiheadAttention(embed, heads, batch_first=True, device=DEVICE, dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    stock = nn.MultiheadAttention(embed, heads, batch_first=True, device=DEVICE, dtype=dtype)
    stock.load_state_dict({n: t.to(dtype) for n, t in ref.state_dict().items()})
    return ref, stock, FusedMultiheadAttention.from_module(stock)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("embed,heads", [(64, 4), (128, 4), (256, 2), (160, 4)])  # head dims 16, 32, 128, 40
@pytest.mark.parametrize("need_weights", [False, True])
def test_layer_matches_nn_multihead_attention(dtype, embed, heads, need_weights):
    _require_cuda_kernels()
    batch, seqlen = 4, 37
    ref, stock, fused = _module_pair(embed, heads, dtype)
    x64 = torch.randn(batch, seqlen, embed, dtype=torch.float64, device=DEVICE)
    padding = torch.zeros(batch, seqlen, dtype=torch.bool, device=DEVICE)
    padding[1, -5:] = True
    x = x64.to(dtype).requires_grad_()
    x_ref = x.detach().double().requires_grad_()
    kwargs = dict(key_padding_mask=padding, need_weights=need_weights)
    out, w = fused(x, x, x, **kwargs)
    out_stock, w_stock = stock(x, x, x, **kwargs)
    out_ref, w_ref = ref(x_ref, x_ref, x_ref, **kwargs)
    n = batch * seqlen  # the longest reduction: weight gradients sum over every token
    assert_within(out, out_stock, out_ref, dtype, "output", n)
    if need_weights:
        assert_within(w, w_stock, w_ref, dtype, "weights", n)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x] + list(fused.parameters()), grad)
    plain = torch.autograd.grad(out_stock, [x] + list(stock.parameters()), grad)
    want = torch.autograd.grad(out_ref, [x_ref] + list(ref.parameters()), grad.double())
    names = ["input"] + [n for n, _ in fused.named_parameters()]
    for g, p, wnt, name in zip(got, plain, want, names):
        assert_within(g, p, wnt, dtype, f"grad {name}", n)


# ---- opcheck: schema, autograd registration, fake tensors, AOT dispatch, on CUDA tensors -----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "causal+padding+float", "bool_3d"])
def test_opcheck_core_ops(dtype, mask):
    _require_cuda_kernels()
    B, H, Lq, Lk, D = 2, 2, 37, 29, 64
    kwargs = {n: (m.to(dtype) if isinstance(m, torch.Tensor) and m.is_floating_point() else m)
              for n, m in MASKS[mask](B, H, Lq, Lk).items()}
    attn_mask, padding, is_causal = kwargs.get("attn_mask"), kwargs.get("key_padding_mask"), kwargs.get("is_causal", False)
    q, k, v = _qkv(B, H, Lq, Lk, D, dtype, requires_grad=True)
    torch.library.opcheck(ops.attention.default, (q, k, v, attn_mask, padding, is_causal, None))
    detached = [t.detach() for t in (q, k, v)]
    out, lse, _ = ops._attention_forward(*detached, attn_mask, padding, is_causal, None, False)
    torch.library.opcheck(ops._attention_forward.default, (*detached, attn_mask, padding, is_causal, 0.5, True))
    torch.library.opcheck(
        ops._attention_backward.default,
        (torch.randn_like(out), None, *detached, lse, attn_mask, padding, is_causal, None),
    )


@pytest.mark.parametrize("need_weights", [False, True])
def test_opcheck_layer_op(need_weights):
    _require_cuda_kernels()
    E, H, L, B = 64, 2, 21, 2
    make = lambda *s: torch.randn(*s, device=DEVICE, requires_grad=True)  # noqa: E731
    x = make(B, L, E)
    padding = torch.zeros(B, L, dtype=torch.bool, device=DEVICE)
    padding[1, -3:] = True
    torch.library.opcheck(
        ops.multi_head_attention.default,
        (x, x, x, H, make(3 * E, E), make(3 * E), make(E, E), None, torch.randn(L, L, device=DEVICE),
         padding, need_weights, True, False, True),
    )
