"""FusedMultiheadAttention against the stock torch.nn.MultiheadAttention, float32.

Outputs, attention weights and every gradient (inputs and parameters) must agree to ~1e-6
relative to each tensor's scale, for every supported combination of layout, bias,
self/cross attention and masks.
"""
import math

import pytest
import torch

from torch import nn

from attn_export import FusedMultiheadAttention
from helpers import DEVICES, assert_rel_close, assert_within, make_pair

pytestmark = pytest.mark.kernels  # stock's rounding depends on the CPU's instruction set too

REL = 2e-6


def _inputs(kind, batch, seqlen_q, seqlen_k, embed_dim, batch_first, unbatched=False):
    def make(length):
        shape = (length, embed_dim) if unbatched else ((batch, length, embed_dim) if batch_first else (length, batch, embed_dim))
        return torch.randn(shape, requires_grad=True)

    query = make(seqlen_q)
    if kind == "self":
        return query, query, query, [query]
    if kind == "shared_kv":  # encoder-decoder cross attention: key is value
        memory = make(seqlen_k)
        return query, memory, memory, [query, memory]
    key, value = make(seqlen_k), make(seqlen_k)
    return query, key, value, [query, key, value]


def _masks(mask_kind, batch, heads, seqlen_q, seqlen_k):
    """(attn_mask, key_padding_mask, is_causal); every query keeps at least one visible key."""
    causal_bool = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).triu(1)
    random_bool = torch.rand(seqlen_q, seqlen_k) < 0.3
    random_bool[:, 0] = False
    padding = torch.zeros(batch, seqlen_k, dtype=torch.bool)
    for b in range(batch):
        padding[b, max(1, seqlen_k - b) :] = True
    if mask_kind == "none":
        return None, None, False
    if mask_kind == "bool_2d":
        return random_bool, None, False
    if mask_kind == "float_2d":
        return torch.randn(seqlen_q, seqlen_k), None, False
    if mask_kind == "causal_float_mask":  # generate_square_subsequent_mask style
        return torch.zeros(seqlen_q, seqlen_k).masked_fill(causal_bool, -math.inf), None, False
    if mask_kind == "is_causal":
        return causal_bool, None, True
    if mask_kind == "bool_3d":
        m = torch.rand(batch * heads, seqlen_q, seqlen_k) < 0.3
        m[..., 0] = False
        return m, None, False
    if mask_kind == "float_3d":
        return torch.randn(batch * heads, seqlen_q, seqlen_k), None, False
    if mask_kind == "padding_bool":
        return None, padding, False
    if mask_kind == "padding_float":
        return None, torch.zeros(batch, seqlen_k).masked_fill(padding, -1e4), False
    if mask_kind == "bool_2d+padding":
        return random_bool, padding, False
    if mask_kind == "float_3d+padding":
        return torch.randn(batch * heads, seqlen_q, seqlen_k), padding, False
    if mask_kind == "is_causal+padding":
        return causal_bool, padding, True
    raise AssertionError(mask_kind)


def _check(ref, fused, query, key, value, leaves, need_weights=True, average=True, **masks):
    out_ref, w_ref = ref(query, key, value, need_weights=need_weights, average_attn_weights=average, **masks)
    out, w = fused(query, key, value, need_weights=need_weights, average_attn_weights=average, **masks)
    assert_rel_close(out, out_ref, REL, "output")
    if need_weights:
        assert_rel_close(w, w_ref, REL, "weights")
    else:
        assert w is None and w_ref is None
    params = [p for p in ref.parameters()]
    grad_out = torch.randn_like(out_ref)
    loss_ref = (out_ref * grad_out).sum() + ((w_ref * w_ref).sum() if need_weights else 0)
    loss = (out * grad_out).sum() + ((w * w).sum() if need_weights else 0)
    names = [f"grad input {i}" for i in range(len(leaves))] + [n for n, _ in ref.named_parameters()]
    for g, g_ref, name in zip(
        torch.autograd.grad(loss, leaves + params), torch.autograd.grad(loss_ref, leaves + params), names
    ):
        assert_rel_close(g, g_ref, REL, name)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["self", "shared_kv", "separate"])
def test_layouts_bias_and_attention_kinds(batch_first, bias, kind):
    batch, heads, embed, seqlen_q = 3, 4, 32, 9
    seqlen_k = seqlen_q if kind == "self" else 6
    ref, fused = make_pair(embed, heads, bias=bias, batch_first=batch_first)
    q, k, v, leaves = _inputs(kind, batch, seqlen_q, seqlen_k, embed, batch_first)
    _check(ref, fused, q, k, v, leaves)


MASK_KINDS = [
    "none", "bool_2d", "float_2d", "causal_float_mask", "is_causal", "bool_3d", "float_3d",
    "padding_bool", "padding_float", "bool_2d+padding", "float_3d+padding", "is_causal+padding",
]


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("kind", ["self", "separate"])
@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)])
def test_masks(mask_kind, kind, need_weights, average):
    batch, heads, embed, seqlen_q = 3, 4, 32, 7
    seqlen_k = seqlen_q if kind == "self" or "causal" in mask_kind else 5
    ref, fused = make_pair(embed, heads, batch_first=True)
    q, k, v, leaves = _inputs(kind, batch, seqlen_q, seqlen_k, embed, True)
    attn_mask, key_padding_mask, is_causal = _masks(mask_kind, batch, heads, seqlen_q, seqlen_k)
    _check(
        ref, fused, q, k, v, leaves, need_weights=need_weights, average=average,
        attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
    )


@pytest.mark.parametrize(
    "batch,seqlen_q,seqlen_k,embed,heads",
    [
        (2, 1, 1, 16, 4),      # sequence length 1
        (1, 1, 9, 16, 2),      # one query, many keys (decoding)
        (4, 5, 5, 24, 1),      # a single head
        (2, 11, 11, 64, 16),   # many heads, head_dim 4
        (1, 70, 70, 32, 2),    # more than one block of queries
        (2, 130, 97, 48, 3),   # odd lengths, head_dim 16, large enough for the BLAS path
    ],
)
@pytest.mark.parametrize("batch_first", [False, True])
def test_sizes(batch, seqlen_q, seqlen_k, embed, heads, batch_first):
    ref, fused = make_pair(embed, heads, batch_first=batch_first)
    kind = "self" if seqlen_q == seqlen_k else "separate"
    q, k, v, leaves = _inputs(kind, batch, seqlen_q, seqlen_k, embed, batch_first)
    _check(ref, fused, q, k, v, leaves)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("with_masks", [False, True])
def test_unbatched(batch_first, with_masks):
    heads, embed, seqlen = 2, 16, 6
    ref, fused = make_pair(embed, heads, batch_first=batch_first)
    q, k, v, leaves = _inputs("separate", 1, seqlen, seqlen, embed, batch_first, unbatched=True)
    masks = {}
    if with_masks:
        padding = torch.zeros(seqlen, dtype=torch.bool)
        padding[-2:] = True
        masks = {"key_padding_mask": padding, "attn_mask": torch.randn(heads, seqlen, seqlen)}
    _check(ref, fused, q, k, v, leaves, **masks)


def test_fully_masked_rows_are_zero_not_nan():
    """nn.MultiheadAttention yields NaN for a query that sees no key; the fused layer yields a
    zero attention output (so the layer output is out_proj.bias) and zero weights, and
    finite gradients. Every other row still matches nn.MultiheadAttention."""
    batch, heads, embed, seqlen = 2, 2, 16, 5
    ref, fused = make_pair(embed, heads, batch_first=True)
    x = torch.randn(batch, seqlen, embed, requires_grad=True)
    attn_mask = torch.zeros(seqlen, seqlen, dtype=torch.bool)
    attn_mask[1] = True  # query 1 sees nothing
    out_ref, w_ref = ref(x, x, x, attn_mask=attn_mask)
    out, w = fused(x, x, x, attn_mask=attn_mask)
    assert torch.isnan(out_ref[:, 1]).all()  # the stock behaviour this project fixes
    assert torch.equal(w[:, 1], torch.zeros_like(w[:, 1]))
    torch.testing.assert_close(out[:, 1], fused.out_proj.bias.expand(batch, embed), rtol=0, atol=0)
    keep = [0, 2, 3, 4]
    assert_rel_close(out[:, keep], out_ref[:, keep], REL, "visible rows")
    assert_rel_close(w[:, keep], w_ref[:, keep], REL, "visible weights")
    grads = torch.autograd.grad(out.sum(), [x] + list(fused.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


def test_all_keys_padded_for_one_batch_element():
    heads, embed, seqlen = 2, 16, 4
    ref, fused = make_pair(embed, heads, batch_first=True)
    x = torch.randn(2, seqlen, embed, requires_grad=True)
    padding = torch.tensor([[False, False, True, True], [True, True, True, True]])
    out, w = fused(x, x, x, key_padding_mask=padding)
    out_ref, w_ref = ref(x, x, x, key_padding_mask=padding)
    assert_rel_close(out[0], out_ref[0], REL, "batch 0")
    assert torch.equal(w[1], torch.zeros_like(w[1]))
    x.grad = None
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("batch_first", [False, True])
def test_causal_without_mask_matches_explicit_causal_mask(batch_first):
    """is_causal=True alone (nn.MultiheadAttention insists on a mask too) applies the mask."""
    ref, fused = make_pair(16, 2, batch_first=batch_first)
    q, k, v, leaves = _inputs("self", 2, 6, 6, 16, batch_first)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    out, _ = fused(q, k, v, is_causal=True, need_weights=False)
    out_ref, _ = ref(q, k, v, attn_mask=causal, need_weights=False)
    assert_rel_close(out, out_ref, REL, "causal output")


def _module_pair(embed, heads, dtype, device):
    ref = nn.MultiheadAttention(embed, heads, batch_first=True, device=device, dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    stock = nn.MultiheadAttention(embed, heads, batch_first=True, device=device, dtype=dtype)
    stock.load_state_dict({n: t.to(dtype) for n, t in ref.state_dict().items()})
    return ref, stock, FusedMultiheadAttention.from_module(stock)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("embed,heads", [(64, 4), (128, 4), (256, 2), (160, 4)])  # head dims 16, 32, 128, 40
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_layer_matches_nn_multihead_attention_in_each_dtype(dtype, embed, heads, need_weights, device):
    """float32/float16/bfloat16 layers against the stock module run in float64, within 2x the
    error of the stock module run in the same dtype (helpers.assert_within)."""
    batch, seqlen = 4, 37
    ref, stock, fused = _module_pair(embed, heads, dtype, device)
    x64 = torch.randn(batch, seqlen, embed, dtype=torch.float64, device=device)
    padding = torch.zeros(batch, seqlen, dtype=torch.bool, device=device)
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
    # Each gradient against its kind's scale: the input's alone, the parameters' together.
    for i, (g, p, wnt, name) in enumerate(zip(got, plain, want, names)):
        assert_within(g, p, wnt, dtype, f"grad {name}", n, scale=want[:1] if i == 0 else want[1:])
