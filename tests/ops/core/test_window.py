"""The sliding window of the attention core (``window``), on the CPU: query i sees only the last
``window`` keys up to its causal diagonal. Against the float64 reference of helpers (the causal
diagonal by triu, the window by tril: written independently of the kernels), for outputs and
gradients, on both CPU kernel families (the flash kernels, which skip the key blocks before a
window, and the row kernels: weights requested, backward without the forward's output), with
grouped-query heads, both alignments, key padding and rows left without any key; float64
gradcheck; and the refusal of a window without causality."""
import pytest
import torch

import attn_export
from attn_export import CausalAlignment
from helpers import assert_rel_close, reference_attention

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels

ops = torch.ops.attn_export
H = 4
ALIGNMENTS = [CausalAlignment.TOP_LEFT, CausalAlignment.BOTTOM_RIGHT]
# Lq < Lk, ==, > (top-left with Lq > Lk leaves rows past the keys without a key once the window
# is short), and long enough for several of the flash kernels' 128-key and 64-query blocks.
LENGTHS = [(5, 9), (7, 7), (9, 5), (70, 150), (150, 70), (300, 300)]
CPU_REL_OUT, CPU_REL_GRAD = 2e-6, 5e-6


def windows(lk):
    """1 (the diagonal alone), short, one key-block and a bit, Lk and past Lk (no effect)."""
    return sorted({1, 3, 130, lk, lk + 5})


def inputs(B, Lq, Lk, D, group, dtype=torch.float32, requires_grad=True):
    make = lambda *s: torch.randn(*s, dtype=dtype, requires_grad=requires_grad)  # noqa: E731
    return make(B, H, Lq, D), make(B, H // group, Lk, D), make(B, H // group, Lk, D)


def padding(B, Lk):
    """Row 0 unpadded, row 1 left-padded over its first half (a generation batch)."""
    mask = torch.zeros(B, Lk, dtype=torch.bool)
    mask[1, : Lk // 2] = True
    return mask


class _RowKernels(torch.autograd.Function):
    """The internal operators with the weights requested (forward) and without the forward's
    output (backward): the CPU row kernels of csrc/kernels/cpu/attention_cpu.cpp."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, alignment, window):
        out, lse, _ = ops._attention_forward(q, k, v, None, key_padding_mask, True, None, True, 0.0, alignment, window)
        ctx.save_for_backward(q, k, v, lse)
        ctx.args = (key_padding_mask, alignment, window)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, lse = ctx.saved_tensors
        key_padding_mask, alignment, window = ctx.args
        dq, dk, dv = ops._attention_backward(grad, None, q, k, v, lse, None, key_padding_mask, True, None, None, 0.0,
                                             alignment, window)
        return dq, dk, dv, None, None, None


def check(q, k, v, kpm, alignment, window, row_kernels=False):
    if row_kernels:
        out = _RowKernels.apply(q, k, v, kpm, int(alignment), window)
    else:
        out = attn_export.attention(q, k, v, key_padding_mask=kpm, is_causal=True, causal_alignment=alignment,
                                    window=window)
    exact, _ = reference_attention(q, k, v, key_padding_mask=kpm, is_causal=True, causal_alignment=alignment,
                                   window=window)
    assert torch.isfinite(out).all()
    assert_rel_close(out, exact, CPU_REL_OUT, f"output, window {window}")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    n = max(q.shape[2], k.shape[2], q.shape[3])
    for g, w, name in zip(got, want, "qkv"):
        assert torch.isfinite(g).all(), f"grad {name}"
        assert_rel_close(g, w, CPU_REL_GRAD, f"grad {name}, window {window}", scale=want, n=n)


@pytest.mark.parametrize("row_kernels", [False, True], ids=["flash", "rows"])
@pytest.mark.parametrize("alignment", ALIGNMENTS, ids=["top_left", "bottom_right"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=[f"{q}x{k}" for q, k in LENGTHS])
def test_window_matches_the_float64_reference(lengths, alignment, row_kernels):
    Lq, Lk = lengths
    torch.manual_seed(Lq * 1000 + Lk)
    for window in windows(Lk):
        for group in (1, 4):  # multi-head and grouped-query (one key/value head for 4 query heads)
            q, k, v = inputs(2, Lq, Lk, 16, group)
            check(q, k, v, padding(2, Lk), alignment, window, row_kernels)


def test_the_window_changes_the_result_and_a_window_past_every_key_does_not():
    """The comparison can fail: a short window differs from plain causal attention, and a window
    that reaches the first key of every row is plain causal attention."""
    torch.manual_seed(0)
    q, k, v = inputs(2, 9, 12, 8, 2, requires_grad=False)
    right = {"is_causal": True, "causal_alignment": CausalAlignment.BOTTOM_RIGHT}
    plain = attn_export.attention(q, k, v, **right)
    assert (attn_export.attention(q, k, v, window=3, **right) - plain).abs().max() > 1e-2
    assert torch.equal(attn_export.attention(q, k, v, window=12, **right), plain)


def test_rows_without_a_key_in_their_window_are_zero_with_zero_gradients():
    """Top-left with Lq > Lk: query i >= Lk + window - 1 has its whole window past the last key;
    such rows (and the rows key padding empties) give 0, never NaN, and pass no gradient."""
    torch.manual_seed(1)
    q, k, v = inputs(2, 12, 5, 8, 1)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1, 2:] = True  # row 1 keeps keys 0 and 1 only: its queries from 3 on see nothing
    out = attn_export.attention(q, k, v, key_padding_mask=kpm, is_causal=True, window=2)
    assert torch.isfinite(out).all()
    assert (out[:, :, 6:] == 0).all()  # i >= Lk + window - 1 = 6: empty windows
    assert (out[1, :, 3:] == 0).all() and (out[1, :, :3] != 0).any()
    out.sum().backward()
    assert (q.grad[:, :, 6:] == 0).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@pytest.mark.parametrize("alignment", ALIGNMENTS, ids=["top_left", "bottom_right"])
def test_gradcheck_in_float64(alignment):
    torch.manual_seed(2)
    q, k, v = inputs(1, 6, 8, 4, 2, dtype=torch.float64)
    kpm = torch.zeros(1, 8, dtype=torch.bool)
    kpm[0, 0] = True

    def run(q, k, v):
        return attn_export.attention(q, k, v, key_padding_mask=kpm, is_causal=True, causal_alignment=alignment,
                                     window=3)

    assert torch.autograd.gradcheck(run, (q, k, v))


def test_a_window_without_causality_is_refused_with_the_fix():
    q, k, v = inputs(1, 3, 3, 4, 1, requires_grad=False)
    with pytest.raises(RuntimeError, match=r"window > 0 needs is_causal=True .*got window=2 with is_causal=False"):
        attn_export.attention(q, k, v, window=2)
    with pytest.raises(RuntimeError, match=r"window must be finite and >= 0"):
        ops.attention(q, k, v, None, None, True, None, 0.0, 0, -1)
    with pytest.raises(ValueError, match=r"window must be >= 0"):
        attn_export.attention(q, k, v, is_causal=True, window=-1)


def test_torch_export_keeps_the_window_on_the_operator():
    """The window is an operator argument in the exported graph (one node, not a mask)."""
    torch.manual_seed(3)
    q, k, v = inputs(1, 5, 7, 4, 1, requires_grad=False)

    class Windowed(torch.nn.Module):
        def forward(self, q, k, v):
            return attn_export.attention(q, k, v, is_causal=True, causal_alignment=CausalAlignment.BOTTOM_RIGHT,
                                         window=3)

    program = torch.export.export(Windowed(), (q, k, v))
    calls = [n for n in program.graph.nodes if n.target is ops.attention.default]
    assert len(calls) == 1 and calls[0].args[-1] == 3
    assert torch.equal(program.module()(q, k, v), Windowed()(q, k, v))
