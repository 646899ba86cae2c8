"""ALiBi as per-head slopes on the attention core (``alibi_slopes``), on the CPU: the score of query
i and key j in head h gets -m[h] * |i + Lk - Lq - j| (FlashAttention's alibi_slopes) after the scale
and the soft-cap, with the masks. Against the float64 reference of helpers (the bias written from
that formula with torch.arange, independently of the kernels), outputs and gradients, on both CPU
kernel families (flash; rows: weights requested, backward without the forward's output), every mask
kind, causal in both alignments, grouped-query heads, cache-like Lq < Lk, the slope sets Bloom and
MPT compute for 4 and 12 heads; float16/bfloat16; rows without a key; float64 gradcheck; slopes
None/empty exactly no ALiBi; bad slopes refused by the wrapper, the operators and the fake kernels
alike."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attn_export
from attn_export import CausalAlignment
from helpers import EPS, assert_rel_close, cuda_skip_reason, reference_attention

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels

ops = torch.ops.attn_export
CPU_REL_OUT, CPU_REL_GRAD = 2e-6, 5e-6


def bloom_slopes(num_heads):
    """transformers' Bloom build_alibi_tensor: powers of 2^(-8/n) for the largest power of two
    n <= num_heads, then every other power of 2^(-4/n) for the heads past it."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, closest + 1)]
    if closest != num_heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 1 + 2 * min(closest, num_heads - closest), 2)]
    return slopes


def mpt_slopes(num_heads, alibi_bias_max=8):
    """MPT's gen_slopes: 2^(-m) for m = (h + 1) * max / n over the next power of two n, then for
    a non-power-of-two head count the odd ones before the even ones, cut to num_heads."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = [1.0 / 2 ** ((h + 1) * alibi_bias_max / n) for h in range(n)]
    if n != num_heads:
        slopes = (slopes[1::2] + slopes[::2])[:num_heads]
    return slopes


SLOPES = {"bloom4": bloom_slopes(4), "mpt4": mpt_slopes(4), "bloom12": bloom_slopes(12), "mpt12": mpt_slopes(12)}


def test_the_slope_sets_are_the_models_own():
    """The interleaving of a non-power-of-two head count, as both models compute it."""
    assert bloom_slopes(4) == mpt_slopes(4) == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    expected12 = [2 ** -e for e in (1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5)]
    assert bloom_slopes(12) == pytest.approx(expected12, rel=1e-15)
    assert mpt_slopes(12) == pytest.approx(expected12, rel=1e-15)


def masks(kind, B, H, Lq, Lk):
    """attn_mask / key_padding_mask of one kind; each leaves row 0's batch every key somewhere."""
    g = torch.Generator().manual_seed(B * 1000 + Lq * 10 + Lk)
    if kind == "none":
        return {}
    if kind == "bool_attn":
        m = torch.rand(B, H, Lq, Lk, generator=g) < 0.3
        m[..., 0] = False
        return {"attn_mask": m}
    if kind == "float_attn":
        return {"attn_mask": torch.randn(Lq, Lk, generator=g)}
    padding = torch.zeros(B, Lk, dtype=torch.bool)
    padding[-1, : Lk // 2] = True  # left padding, as a generation batch has it
    if kind == "bool_padding":
        return {"key_padding_mask": padding}
    return {"key_padding_mask": torch.zeros(B, Lk).masked_fill(padding, -math.inf) + 0.5}  # float_padding


CAUSAL = {"none": {}, "top_left": {"is_causal": True},
          "bottom_right": {"is_causal": True, "causal_alignment": CausalAlignment.BOTTOM_RIGHT}}

# (mask kind, causality, key/value heads group, Lq x Lk, slope set, kernels): each mask kind with
# each causality, with GQA, cache-like shapes (a decode step, a chunk over a longer cache), Lq > Lk,
# both slope sets and both kernel families spread over the cases rather than multiplied out. 70 x 150
# and 150 x 70 span several of the flash kernels' 64-query and 128-key blocks.
CASES = [
    ("none", "none", 1, (7, 7), "bloom4", "flash"),
    ("none", "bottom_right", 2, (1, 9), "mpt12", "flash"),
    ("none", "top_left", 4, (70, 150), "bloom4", "rows"),
    ("bool_attn", "none", 2, (5, 9), "mpt4", "rows"),
    ("bool_attn", "top_left", 1, (9, 5), "bloom12", "flash"),
    ("bool_attn", "bottom_right", 4, (150, 70), "mpt4", "flash"),
    ("float_attn", "none", 4, (1, 9), "bloom4", "flash"),
    ("float_attn", "top_left", 2, (5, 9), "mpt12", "rows"),
    ("float_attn", "bottom_right", 1, (70, 150), "bloom12", "flash"),
    ("bool_padding", "none", 1, (70, 150), "mpt12", "flash"),
    ("bool_padding", "top_left", 4, (7, 7), "mpt4", "flash"),
    ("bool_padding", "bottom_right", 2, (5, 9), "bloom4", "rows"),
    ("float_padding", "none", 2, (9, 5), "bloom12", "rows"),
    ("float_padding", "top_left", 1, (5, 9), "mpt4", "rows"),
    ("float_padding", "bottom_right", 4, (70, 150), "mpt12", "flash"),
]


class _RowKernels(torch.autograd.Function):
    """The internal operators with the weights requested (forward) and without the forward's
    output (backward): the CPU row kernels of csrc/kernels/cpu/attention_cpu.cpp."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding_mask, is_causal, alignment, slopes):
        out, lse, _ = ops._attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, None, True, 0.0,
                                             alignment, 0, slopes)
        ctx.save_for_backward(q, k, v, lse)
        ctx.args = (attn_mask, key_padding_mask, is_causal, alignment, slopes)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, lse = ctx.saved_tensors
        attn_mask, key_padding_mask, is_causal, alignment, slopes = ctx.args
        dq, dk, dv = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, key_padding_mask, is_causal, None,
                                             None, 0.0, alignment, 0, slopes)
        return dq, dk, dv, None, None, None, None, None


def inputs(B, H, Lq, Lk, D, group, dtype=torch.float32, requires_grad=True):
    make = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    return make(B, H, Lq, D), make(B, H // group, Lk, D), make(B, H // group, Lk, D)


@pytest.mark.parametrize("case", CASES, ids=["-".join(str(x) for x in c) for c in CASES])
def test_alibi_matches_the_float64_reference(case):
    mask, causal, group, (Lq, Lk), slope_set, kernels = case
    slopes = SLOPES[slope_set]
    H = len(slopes)
    torch.manual_seed(Lq * 1000 + Lk + H)
    q, k, v = inputs(2, H, Lq, Lk, 16, group)
    kwargs = {**masks(mask, 2, H, Lq, Lk), **CAUSAL[causal]}
    if kernels == "rows":
        out = _RowKernels.apply(q, k, v, kwargs.get("attn_mask"), kwargs.get("key_padding_mask"),
                                kwargs.get("is_causal", False), int(kwargs.get("causal_alignment", 0)), slopes)
    else:
        out = attn_export.attention(q, k, v, alibi_slopes=slopes, **kwargs)
    exact, _ = reference_attention(q, k, v, alibi_slopes=slopes, **kwargs)
    plain, _ = reference_attention(q, k, v, **kwargs)
    assert (exact - plain).abs().max() > 1e-2, "the slopes must change this case's result"
    assert_rel_close(out, exact, CPU_REL_OUT, "output")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    n = max(Lq, Lk, 16)
    for g, w, name in zip(got, want, "qkv"):
        assert_rel_close(g, w, CPU_REL_GRAD, f"grad {name}", scale=want, n=n)


def test_alibi_with_softcap_adds_the_bias_after_the_cap():
    """The bias comes after the soft-cap (a capped score plus -m |d|), forward and backward."""
    torch.manual_seed(5)
    slopes = SLOPES["bloom4"]
    q, k, v = inputs(1, 4, 6, 11, 8, 2)
    out = attn_export.attention(q, k, v, scale=1.0, softcap=1.5, alibi_slopes=slopes, is_causal=True,
                                causal_alignment=CausalAlignment.BOTTOM_RIGHT)
    exact, _ = reference_attention(q, k, v, scale=1.0, softcap=1.5, alibi_slopes=slopes, is_causal=True,
                                   causal_alignment=1)
    assert_rel_close(out, exact, CPU_REL_OUT, "output")
    grad = torch.randn_like(out)
    for g, w, name in zip(torch.autograd.grad(out, (q, k, v), grad),
                          torch.autograd.grad(exact, (q, k, v), grad.double()), "qkv"):
        assert_rel_close(g, w, CPU_REL_GRAD, f"grad {name}", scale=w, n=11)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_with_slopes_accumulates_in_float32(dtype):
    slopes = SLOPES["mpt12"]
    torch.manual_seed(6)
    q, k, v = inputs(2, 12, 9, 33, 32, 3, dtype=dtype)
    kwargs = {**masks("bool_padding", 2, 12, 9, 33), **CAUSAL["bottom_right"]}
    out = attn_export.attention(q, k, v, alibi_slopes=slopes, **kwargs)
    assert out.dtype == dtype
    expected, _ = reference_attention(q, k, v, alibi_slopes=slopes, **kwargs)
    assert_rel_close(out, expected, 4 * EPS[dtype], "output")
    grad = torch.randn_like(out)
    for g, w, name in zip(torch.autograd.grad(out, (q, k, v), grad),
                          torch.autograd.grad(expected, (q, k, v), grad.double()), "qkv"):
        assert g.dtype == dtype
        assert_rel_close(g, w, 8 * EPS[dtype], f"grad {name}")


@pytest.mark.parametrize("kernels", ["flash", "rows"])
def test_rows_without_a_key_are_zero_with_finite_gradients(kernels):
    """Every key of batch row 1 padded: a -inf mask plus the finite bias is still -inf, so the
    row outputs 0, never NaN, and passes no gradient to its queries."""
    torch.manual_seed(7)
    slopes = SLOPES["bloom4"]
    q, k, v = inputs(2, 4, 5, 8, 4, 2)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[1] = True
    if kernels == "rows":
        out = _RowKernels.apply(q, k, v, None, padding, True, 1, slopes)
    else:
        out = attn_export.attention(q, k, v, key_padding_mask=padding, is_causal=True,
                                    causal_alignment=CausalAlignment.BOTTOM_RIGHT, alibi_slopes=slopes)
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (out[0] != 0).any()
    out.sum().backward()
    assert (q.grad[1] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("kernels", ["flash", "rows"])
@pytest.mark.parametrize("alignment", [0, 1], ids=["top_left", "bottom_right"])
def test_gradcheck_in_float64(kernels, alignment):
    torch.manual_seed(8)
    slopes = [0.7, 0.25, 1.5, 0.05]
    q, k, v = inputs(1, 4, 5, 7, 4, 2, dtype=torch.float64)
    padding = torch.zeros(1, 7, dtype=torch.bool)
    padding[0, 0] = True

    def run(q, k, v):
        if kernels == "rows":
            return _RowKernels.apply(q, k, v, None, padding, True, alignment, slopes)
        return attn_export.attention(q, k, v, key_padding_mask=padding, is_causal=True, causal_alignment=alignment,
                                     alibi_slopes=slopes)

    assert torch.autograd.gradcheck(run, (q, k, v))


def test_no_slopes_is_exactly_no_alibi():
    """None, an empty list and an empty tensor are off: bit for bit what a call without them gives
    (the operator and the wrapper); zero slopes add -0 and change nothing either; slopes do."""
    torch.manual_seed(9)
    q, k, v = inputs(2, 4, 6, 9, 8, 2, requires_grad=False)
    padding = masks("bool_padding", 2, 4, 6, 9)["key_padding_mask"]
    plain = ops.attention(q, k, v, None, padding, True, None)
    for off in (None, [], torch.empty(0)):
        assert torch.equal(attn_export.attention(q, k, v, key_padding_mask=padding, is_causal=True, alibi_slopes=off),
                           plain)
    assert torch.equal(ops.attention(q, k, v, None, padding, True, None, 0.0, 0, 0, None), plain)
    assert torch.equal(ops.attention(q, k, v, None, padding, True, None, 0.0, 0, 0, []), plain)
    assert torch.equal(attn_export.attention(q, k, v, key_padding_mask=padding, is_causal=True,
                                             alibi_slopes=[0.0] * 4), plain)
    with_slopes = attn_export.attention(q, k, v, key_padding_mask=padding, is_causal=True,
                                        alibi_slopes=torch.tensor(SLOPES["bloom4"]))
    assert (with_slopes - plain).abs().max() > 1e-2


def test_slopes_index_query_heads_under_grouped_query_attention():
    """Four query heads over one key/value head: head h's slope is slopes[h], not the kv head's."""
    torch.manual_seed(10)
    q, k, v = inputs(1, 4, 5, 5, 8, 4, requires_grad=False)
    slopes = [0.0, 0.0, 0.0, 2.0]
    out = attn_export.attention(q, k, v, alibi_slopes=slopes)
    plain = attn_export.attention(q, k, v)
    assert torch.equal(out[:, :3], plain[:, :3]) and (out[:, 3] - plain[:, 3]).abs().max() > 1e-2


BAD_SLOPES = {
    "too few": ([0.5, 0.25, 0.125], "must have one slope per query head (num_heads = 4); got 3 slopes"),
    "too many": ([0.5] * 5, "must have one slope per query head (num_heads = 4); got 5 slopes"),
    "nan": ([0.5, float("nan"), 0.1, 0.1], "must be finite float32 numbers; got nan for head 1"),
    "inf": ([0.5, 0.1, 0.1, -float("inf")], "must be finite float32 numbers; got -inf for head 3"),
    "past float32": ([1e300, 0.1, 0.1, 0.1], "must be finite float32 numbers; got 1e+300 for head 0"),
}


@pytest.mark.parametrize("case", list(BAD_SLOPES))
def test_bad_slopes_are_refused_alike_by_the_operators_and_the_fake_kernels(case):
    slopes, words = BAD_SLOPES[case]
    q, k, v = inputs(1, 4, 3, 5, 8, 2, requires_grad=False)
    lse = torch.zeros(1, 4, 3)
    calls = ((ops.attention, (q, k, v, None, None, False, None, 0.0, 0, 0, slopes)),
             (ops._attention_forward, (q, k, v, None, None, False, None, False, 0.0, 0, 0, slopes)),
             (ops._attention_backward, (q, None, q, k, v, lse, None, None, False, None, None, 0.0, 0, 0, slopes)))
    for op, args in calls:
        with pytest.raises(RuntimeError) as real:
            op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            with pytest.raises(RuntimeError) as fake:
                op(*fake_args)
        message = str(real.value).splitlines()[0]
        assert message == str(fake.value).splitlines()[0]
        assert f"attention: alibi_slopes {words}" in message and "or None for no ALiBi" in message
    with pytest.raises(ValueError, match=r"alibi_slopes must (have one slope|be finite)"):
        attn_export.attention(q, k, v, alibi_slopes=slopes)


@pytest.mark.parametrize("slopes, words", [
    ("0.5", "sequence of floats"), (0.5, "sequence of floats"), (["0.5"] * 4, "real numbers; got str"),
    ([True] * 4, "real numbers; got bool"), (torch.ones(2, 2), "1-D floating tensor"),
    (torch.ones(4, dtype=torch.long), "1-D floating tensor"),
])
def test_the_wrapper_refuses_what_is_not_slopes(slopes, words):
    q, k, v = inputs(1, 4, 3, 5, 8, 1, requires_grad=False)
    with pytest.raises(TypeError, match=words):
        attn_export.attention(q, k, v, alibi_slopes=slopes)


def test_torch_export_keeps_the_slopes_on_the_operator():
    """The slopes are a constant list argument of the one exported node (no [B, H, L, L] bias)."""
    torch.manual_seed(11)
    q, k, v = inputs(1, 4, 5, 7, 4, 1, requires_grad=False)
    slopes = SLOPES["mpt4"]

    class Alibi(torch.nn.Module):
        def forward(self, q, k, v):
            return attn_export.attention(q, k, v, is_causal=True, causal_alignment=CausalAlignment.BOTTOM_RIGHT,
                                         alibi_slopes=slopes)

    program = torch.export.export(Alibi(), (q, k, v))
    calls = [n for n in program.graph.nodes if n.target is ops.attention.default]
    assert len(calls) == 1 and list(calls[0].args[-1]) == slopes
    assert torch.equal(program.module()(q, k, v), Alibi()(q, k, v))


@pytest.mark.slow  # ~5 s: opcheck traces each operator several ways
def test_opcheck_with_slopes():
    """Schema, fake kernels, autograd registration and AOT dispatch of the three core operators
    with slopes (torch.library.opcheck)."""
    torch.manual_seed(12)
    slopes = SLOPES["bloom4"]
    q, k, v = inputs(1, 4, 3, 6, 8, 2, dtype=torch.float64)
    padding = masks("bool_padding", 1, 4, 3, 6)["key_padding_mask"]
    torch.library.opcheck(ops.attention.default, (q, k, v, None, padding, True, None, 0.0, 1, 0, slopes))
    q, k, v = (t.detach() for t in (q, k, v))  # the internal kernels have no derivative of their own
    out, lse, _ = ops._attention_forward(q, k, v, None, padding, True, None, False, 0.0, 1, 0, slopes)
    torch.library.opcheck(ops._attention_forward.default, (q, k, v, None, padding, True, None, True, 0.0, 1, 0, slopes))
    torch.library.opcheck(ops._attention_backward.default,
                          (torch.randn_like(out), None, q, k, v, lse, None, padding, True, None, out, 0.0, 1, 0, slopes))


@pytest.mark.cuda
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=cuda_skip_reason() or "")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_takes_slopes(dtype):
    """The CUDA kernels add the bias (flash and generic, forward and backward): the CPU operator's
    result and gradients, within the dtype's tolerance, on a bottom-right causal Lq < Lk case with GQA
    and a padded key (tests/ops/cuda/test_cuda_alibi.py checks the kernels themselves, emulated)."""
    slopes = SLOPES["bloom4"]
    torch.manual_seed(7)
    q, k, v = inputs(2, 4, 5, 9, 32, 2, dtype=dtype)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, :3] = True
    kwargs = {"key_padding_mask": padding, "is_causal": True, "causal_alignment": CausalAlignment.BOTTOM_RIGHT}
    exact, _ = reference_attention(q, k, v, alibi_slopes=slopes, **kwargs)
    dev = [t.detach().cuda().requires_grad_() for t in (q, k, v)]
    out = attn_export.attention(*dev, alibi_slopes=slopes, key_padding_mask=padding.cuda(), is_causal=True,
                                causal_alignment=CausalAlignment.BOTTOM_RIGHT)
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    assert_rel_close(out.cpu(), exact, rel, "output")
    grad = torch.randn_like(exact)
    got = torch.autograd.grad(out, dev, grad.to(dtype).cuda())
    want = torch.autograd.grad(exact, (q, k, v), grad)
    for g, w, name in zip(got, want, "qkv"):
        assert_rel_close(g.cpu(), w, rel * 4, f"grad {name}", scale=w, n=16)