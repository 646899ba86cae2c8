"""Grouped-query attention (key/value heads dividing the query heads) and the bottom-right causal
alignment of the attention core, on the CPU: against the float64 reference of helpers (which
repeats each key/value head for its group and draws the causal diagonal with triu), against
F.scaled_dot_product_attention(enable_gqa=True, causal_lower_right), float64 gradcheck, opcheck,
and torch.export. Both CPU kernel families are reached: the flash kernels (attn_export.attention)
and the row kernels (the weights requested, or the backward without the forward's output)."""
import pytest
import torch
import torch.nn.functional as F

import attn_export
from attn_export import CausalAlignment
from helpers import EPS, MASKS, assert_rel_close, assert_within, masks_in, reference_attention

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels

ops = torch.ops.attn_export
f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

H = 8
GROUPS = [1, 2, 4, 8]  # query heads per key/value head: MHA, GQA, GQA, MQA
ALIGNMENTS = [CausalAlignment.TOP_LEFT, CausalAlignment.BOTTOM_RIGHT]
# Lq < Lk, Lq == Lk, Lq > Lk (bottom-right leaves the first Lq - Lk rows without a key), small
# (the flash kernels' one block) and long enough for several query and key blocks.
LENGTHS = [(5, 9), (7, 7), (9, 5), (70, 150), (150, 70)]
CPU_REL_OUT, CPU_REL_GRAD = 2e-6, 5e-6


def gqa_inputs(B, Lq, Lk, D, group, dtype=f32, Dv=None, requires_grad=True):
    make = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    return make(B, H, Lq, D), make(B, H // group, Lk, D), make(B, H // group, Lk, D if Dv is None else Dv)


def causal(alignment):
    return {"is_causal": True, "causal_alignment": alignment}


def check_against_reference(q, k, v, masks, rel_out, rel_grad, *, need_weights_path=False):
    """Output and dQ, dK, dV against the float64 reference (dK/dV: the expanded reference's
    gradients summed over each group, by autograd through repeat_interleave)."""
    if need_weights_path:  # the row kernels: weights requested, backward without the output
        out = row_kernels_attention(q, k, v, **masks)
    else:
        out = attn_export.attention(q, k, v, **masks)
    exact, _ = reference_attention(q, k, v, **masks)
    assert out.shape == exact.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    assert_rel_close(out, exact, rel_out, "output")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    n = max(q.shape[2], k.shape[2], q.shape[3])
    for g, w, t, name in zip(got, want, (q, k, v), "qkv"):
        assert g.shape == t.shape and g.dtype == t.dtype, f"grad {name}"
        assert_rel_close(g, w, rel_grad, f"grad {name}", scale=want, n=n)


class _RowKernels(torch.autograd.Function):
    """The internal operators with the weights requested (forward) and without the forward's
    output (backward): the CPU row kernels of csrc/kernels/cpu/attention_cpu.cpp."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding_mask, is_causal, causal_alignment):
        out, lse, _ = ops._attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, None, True, 0.0,
                                             causal_alignment)
        ctx.save_for_backward(q, k, v, lse)
        ctx.args = (attn_mask, key_padding_mask, is_causal, causal_alignment)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, lse = ctx.saved_tensors
        attn_mask, key_padding_mask, is_causal, causal_alignment = ctx.args
        dq, dk, dv = ops._attention_backward(grad, None, q, k, v, lse, attn_mask, key_padding_mask, is_causal, None,
                                             None, 0.0, causal_alignment)
        return dq, dk, dv, None, None, None, None


def row_kernels_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, causal_alignment=0):
    return _RowKernels.apply(q, k, v, attn_mask, key_padding_mask, is_causal, int(causal_alignment))


@pytest.mark.parametrize("row_kernels", [False, True], ids=["flash", "rows"])
@pytest.mark.parametrize("Lq,Lk", LENGTHS)
@pytest.mark.parametrize("alignment", ALIGNMENTS, ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("group", GROUPS)
def test_causal_gqa_matches_float64_reference(group, alignment, Lq, Lk, row_kernels):
    q, k, v = gqa_inputs(2, Lq, Lk, 16, group)
    check_against_reference(q, k, v, causal(alignment), CPU_REL_OUT, CPU_REL_GRAD, need_weights_path=row_kernels)


@pytest.mark.parametrize("mask", list(MASKS))
# The fast tier: the short lengths; the slow tier also several key and query tiles (70 x 150).
@pytest.mark.parametrize("Lq,Lk", [(6, 11), (11, 6), pytest.param(70, 150, marks=pytest.mark.slow)])
@pytest.mark.parametrize("group", [2, 8])
def test_every_mask_with_gqa_and_bottom_right(group, Lq, Lk, mask):
    """Every mask kind; the causal ones bottom-right. Masks are per query head ([B*H, Lq, Lk])."""
    q, k, v = gqa_inputs(2, Lq, Lk, 16, group)
    masks = MASKS[mask](2, H, Lq, Lk)
    if masks.get("is_causal"):
        masks["causal_alignment"] = CausalAlignment.BOTTOM_RIGHT
    for row_kernels in (False, True):
        check_against_reference(q, k, v, masks, CPU_REL_OUT, CPU_REL_GRAD, need_weights_path=row_kernels)


@pytest.mark.parametrize("softcap", [0.7, 5.0])
@pytest.mark.parametrize("group", [1, 4])
def test_softcap_with_gqa_and_bottom_right(group, softcap):
    q, k, v = gqa_inputs(2, 13, 29, 16, group)
    masks = {**MASKS["causal+padding+float"](2, H, 13, 29), "causal_alignment": 1, "softcap": softcap}
    check_against_reference(q, k, v, masks, CPU_REL_OUT, CPU_REL_GRAD)


@pytest.mark.parametrize("dtype", [f16, bf16])
@pytest.mark.parametrize("group", [2, 8])
def test_half_precision_gqa_bottom_right(dtype, group):
    """float16/bfloat16 in, float32 inside: a few units of the dtype's rounding."""
    q, k, v = gqa_inputs(2, 33, 47, 32, group, dtype=dtype)
    masks = {**masks_in(MASKS["causal+padding+float"](2, H, 33, 47), dtype), "causal_alignment": 1}
    check_against_reference(q, k, v, masks, 4 * EPS[dtype], 8 * EPS[dtype])


@pytest.mark.parametrize("Lq,Lk", [(5, 9), (9, 9), (1, 40), (64, 200)])
@pytest.mark.parametrize("alignment", ALIGNMENTS, ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("group", GROUPS)
def test_matches_sdpa_enable_gqa(group, alignment, Lq, Lk):
    """Against PyTorch's own kernels: F.scaled_dot_product_attention(enable_gqa=True), top-left
    as its is_causal, bottom-right as causal_lower_right (Lq <= Lk: SDPA gives NaN for rows
    that see no key). The gradients too, in float32 with SDPA's own float32 rounding."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = gqa_inputs(2, Lq, Lk, 16, group)
    out = attn_export.attention(q, k, v, is_causal=True, causal_alignment=alignment)
    if alignment == CausalAlignment.TOP_LEFT:
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(Lq, Lk), enable_gqa=True)
    exact, _ = reference_attention(q, k, v, is_causal=True, causal_alignment=alignment)
    assert_within(out, sdpa, exact, f32, "output", n=Lk)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    plain = torch.autograd.grad(sdpa, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    for g, p, w, name in zip(got, plain, want, "qkv"):
        assert_within(g, p, w, f32, f"grad {name}", n=Lk, scale=want)


@pytest.mark.parametrize("row_kernels", [False, True], ids=["flash", "rows"])
@pytest.mark.parametrize("group", [1, 4])
def test_rows_that_see_no_key_give_zeros_and_lse_minus_inf(group, row_kernels):
    """Bottom-right with Lq > Lk: rows i < Lq - Lk see no key: output 0, lse -inf, and their
    gradients 0, never NaN; every other row is unaffected."""
    Lq, Lk = 12, 5
    q, k, v = gqa_inputs(1, Lq, Lk, 8, group)
    out, lse, _ = ops._attention_forward(q, k, v, None, None, True, None, row_kernels, 0.0, 1)
    assert torch.equal(out[:, :, : Lq - Lk], torch.zeros_like(out[:, :, : Lq - Lk]))
    assert torch.isneginf(lse[:, :, : Lq - Lk]).all() and torch.isfinite(lse[:, :, Lq - Lk:]).all()
    attend = row_kernels_attention if row_kernels else attn_export.attention
    out = attend(q, k, v, is_causal=True, causal_alignment=1)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert torch.equal(dq[:, :, : Lq - Lk], torch.zeros_like(dq[:, :, : Lq - Lk]))
    # The last row sees every key (bottom-right): its output is the plain softmax over all keys.
    exact, _ = reference_attention(q[:, :, -1:], k, v)
    assert_rel_close(out[:, :, -1:], exact, CPU_REL_OUT, "last row")


def test_bottom_right_equals_top_left_when_lengths_agree():
    q, k, v = gqa_inputs(2, 17, 17, 8, 2, requires_grad=False)
    assert torch.equal(attn_export.attention(q, k, v, is_causal=True, causal_alignment=1),
                       attn_export.attention(q, k, v, is_causal=True))


def test_alignment_without_is_causal_changes_nothing():
    q, k, v = gqa_inputs(2, 5, 9, 8, 2, requires_grad=False)
    assert torch.equal(attn_export.attention(q, k, v, causal_alignment=1), attn_export.attention(q, k, v))


def test_expanded_key_value_give_the_same_result():
    """GQA is the expanded multi-head call, bit for bit in the forward (same kernels, same order)."""
    q, k, v = gqa_inputs(2, 40, 60, 16, 4, requires_grad=False)
    expanded = [t.repeat_interleave(4, dim=1) for t in (k, v)]
    for masks in ({}, causal(0), causal(1)):
        assert torch.equal(attn_export.attention(q, k, v, **masks), attn_export.attention(q, *expanded, **masks))


@pytest.mark.parametrize("masks", [
    {"is_causal": True, "causal_alignment": 1},
    {"is_causal": True, "causal_alignment": 0, "key_padding_mask": "padding"},
    {"attn_mask": "bool_3d"},
], ids=["bottom_right", "top_left+padding", "bool_3d"])
# The fast tier: more keys than queries (the cache's shape); the slow tier also the other way.
@pytest.mark.parametrize("Lq,Lk", [(3, 5), pytest.param(5, 3, marks=pytest.mark.slow)])
def test_gradcheck_gqa_float64(masks, Lq, Lk):
    B = 2
    make = lambda *s: torch.randn(*s, dtype=f64, requires_grad=True)  # noqa: E731
    q, k, v = make(B, 4, Lq, 4), make(B, 2, Lk, 4), make(B, 2, Lk, 4)  # two query heads per key head
    kwargs = dict(masks)
    if kwargs.get("key_padding_mask") == "padding":
        kwargs["key_padding_mask"] = MASKS["padding_bool"](B, 4, Lq, Lk)["key_padding_mask"]
    if kwargs.get("attn_mask") == "bool_3d":
        kwargs["attn_mask"] = MASKS["bool_3d"](B, 4, Lq, Lk)["attn_mask"]
    torch.autograd.gradcheck(lambda *t: attn_export.attention(*t, **kwargs), (q, k, v))
    torch.autograd.gradcheck(lambda *t: row_kernels_attention(*t, **kwargs), (q, k, v))


@pytest.mark.parametrize("dtype", [f32, pytest.param(f64, marks=pytest.mark.slow)])  # the fast tier: float32
@pytest.mark.parametrize("alignment", [0, 1])
def test_opcheck_gqa(dtype, alignment):
    q, k, v = gqa_inputs(2, 6, 4, 8, 4, dtype=dtype)
    mask = MASKS["padding_bool"](2, H, 6, 4)["key_padding_mask"]
    torch.library.opcheck(ops.attention.default, (q, k, v, None, mask, True, None, 0.0, alignment))
    detached = [t.detach() for t in (q, k, v)]
    out, lse, _ = ops._attention_forward(*detached, None, mask, True, None, False, 0.0, alignment)
    torch.library.opcheck(ops._attention_forward.default, (*detached, None, mask, True, None, True, 0.0, alignment))
    for output in (None, out):  # the row kernels' backward, then the flash one
        torch.library.opcheck(ops._attention_backward.default,
                              (torch.randn_like(out), None, *detached, lse, None, mask, True, None, output, 0.0,
                               alignment))


def test_export_keeps_one_node_with_dynamic_batch_and_lengths():
    class Decoder(torch.nn.Module):
        def forward(self, q, k, v):
            return attn_export.attention(q, k, v, is_causal=True, causal_alignment=CausalAlignment.BOTTOM_RIGHT)

    q, k, v = gqa_inputs(2, 5, 9, 16, 4, requires_grad=False)
    batch, seq_q, seq_k = torch.export.Dim("batch"), torch.export.Dim("seq_q"), torch.export.Dim("seq_k")
    shapes = ({0: batch, 2: seq_q}, {0: batch, 2: seq_k}, {0: batch, 2: seq_k})
    program = torch.export.export(Decoder(), (q, k, v), dynamic_shapes=shapes)
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    assert [n.target for n in nodes] == [ops.attention.default]
    assert nodes[0].args[-1] == 1 or nodes[0].kwargs.get("causal_alignment") == 1
    q2, k2, v2 = gqa_inputs(3, 7, 20, 16, 4, requires_grad=False)
    assert torch.equal(program.module()(q2, k2, v2),
                       attn_export.attention(q2, k2, v2, is_causal=True, causal_alignment=1))


@pytest.mark.parametrize("bad", [2, -1, 7])
def test_bad_causal_alignment_is_refused_clearly(bad):
    q, k, v = gqa_inputs(1, 3, 3, 4, 1, requires_grad=False)
    with pytest.raises(RuntimeError, match=r"causal_alignment must be 0 or 1 \(0 = top-left.*1 = bottom-right.*got "
                                           + str(bad)):
        attn_export.attention(q, k, v, is_causal=True, causal_alignment=bad)


def test_heads_that_do_not_divide_are_refused_clearly():
    q = torch.randn(1, 6, 3, 4)
    k = v = torch.randn(1, 4, 3, 4)
    with pytest.raises(RuntimeError, match=r"key and value heads must divide the query heads; got query \[1, 6, 3, 4\]"
                                           r".*H % Hkv == 0"):
        attn_export.attention(q, k, v)


def test_causal_alignment_values_are_named():
    assert int(CausalAlignment.TOP_LEFT) == 0 and int(CausalAlignment.BOTTOM_RIGHT) == 1
    assert attn_export.CausalAlignment is CausalAlignment and "CausalAlignment" in attn_export.__all__
