"""Edge cases of the attention core against independent references: float64 weights when the
key length is a multiple of the kernels' row padding (16), and zero-size inputs of every
layout against F.scaled_dot_product_attention and nn.MultiheadAttention."""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attn_export
from helpers import assert_parity

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("seqlen_k", [16, 32, 48])
def test_float64_weights_with_causal_blocks_shorter_than_padded_rows(seqlen_k):
    # is_causal with 3 queries leaves 3 visible keys per block: rows whose padding the weights
    # path hands out when Lk is a multiple of 16 (float64 runs the plain row loops).
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(4, 1, batch_first=True, dtype=torch.float64)
    fused = attn_export.FusedMultiheadAttention.from_module(stock)
    q = torch.randn(2, 3, 4, dtype=torch.float64)
    kv = torch.randn(2, seqlen_k, 4, dtype=torch.float64)
    mask = torch.ones(3, seqlen_k, dtype=torch.bool).triu(1)
    for average in (True, False):
        ref_out, ref_w = stock(q, kv, kv, attn_mask=mask, need_weights=True, average_attn_weights=average)
        out, w = fused(q, kv, kv, attn_mask=mask, is_causal=True, need_weights=True, average_attn_weights=average)
        assert_parity(out, ref_out, 1e-12, "output", n=seqlen_k)
        assert_parity(w, ref_w, 1e-12, "weights", n=seqlen_k)


_SIZES = {  # B, H, Lq, Lk, D, Dv
    "batch0": (0, 2, 5, 6, 8, 8),
    "heads0": (2, 0, 5, 6, 8, 8),
    "lq0": (2, 2, 0, 6, 8, 8),
    "lk0": (2, 2, 5, 0, 8, 8),  # every row fully masked: zeros
    "d0": (2, 2, 5, 6, 0, 8),
    "dv0": (2, 2, 5, 6, 8, 0),
    "all0": (0, 0, 0, 0, 0, 0),
}


def _tensor(b, h, length, dim, layout, gen):
    if layout == "contiguous":
        return torch.randn(b, h, length, dim, dtype=torch.float64, generator=gen)
    if layout == "strided":  # every other feature: last-dim stride 2
        return torch.randn(b, h, length, 2 * dim, dtype=torch.float64, generator=gen)[..., ::2]
    if layout == "token_major":
        return torch.randn(b, length, h, dim, dtype=torch.float64, generator=gen).transpose(1, 2)
    return torch.randn(b, h, dim, length, dtype=torch.float64, generator=gen).transpose(2, 3)


@pytest.mark.parametrize("layout", ["contiguous", "strided", "token_major", "transposed"])
@pytest.mark.parametrize("name", list(_SIZES))
def test_zero_size_inputs_match_sdpa(name, layout):
    b, h, lq, lk, d, dv = _SIZES[name]
    gen = torch.Generator().manual_seed(1)
    for is_causal in (False, True):
        q = _tensor(b, h, lq, d, layout, gen).requires_grad_()
        k = _tensor(b, h, lk, d, layout, gen).requires_grad_()
        v = _tensor(b, h, lk, dv, layout, gen).requires_grad_()
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        out = attn_export.attention(q, k, v, is_causal=is_causal)
        assert_parity(out, ref, 1e-12, "output", n=max(lk, d))
        # sum(): an expanded (stride 0) output gradient, as most losses give
        ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for g, r, name in zip(grads, ref_grads, "qkv"):
            assert_parity(g, r, 1e-12, f"grad {name}", scale=ref_grads, n=max(lq, lk, d, dv))


@pytest.mark.parametrize(
    "extra", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 6, "vdim": 4}], ids=str
)
@pytest.mark.parametrize("batch_first", [True, False])
def test_zero_size_layer_matches_stock(batch_first, extra):
    torch.manual_seed(2)
    stock = nn.MultiheadAttention(8, 2, batch_first=batch_first, dtype=torch.float64, **extra)
    fused = attn_export.FusedMultiheadAttention.from_module(stock)
    kdim, vdim = extra.get("kdim", 8), extra.get("vdim", 8)
    for (b, lq, lk), need_weights in itertools.product([(0, 5, 6), (2, 0, 6), (2, 5, 0), (0, 0, 0)], [True, False]):
        def make(length, dim):
            return torch.randn(*((b, length, dim) if batch_first else (length, b, dim)), dtype=torch.float64)

        inputs = [make(lq, 8).requires_grad_(), make(lk, kdim).requires_grad_(), make(lk, vdim).requires_grad_()]
        results = []
        for module in (stock, fused):
            out, w = module(*inputs, need_weights=need_weights)
            loss = out.sum() + (w.sum() if w is not None else 0)
            leaves = inputs + list(module.parameters())
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
            results.append((out, w, grads))
        (ref_out, ref_w, ref_grads), (out, w, grads) = results
        assert_parity(out, ref_out, 1e-12, "output", n=max(lk, 8))
        if need_weights:
            assert_parity(w, ref_w, 1e-12, "weights", n=8)
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            assert_parity(g, r, 1e-12, f"grad {i}", scale=ref_grads, n=max(b * lq, b * lk, 8))


def test_zero_size_fake_kernels_agree():
    q = torch.randn(0, 2, 5, 8)
    k = torch.randn(0, 2, 6, 16)[..., ::2]
    v = torch.randn(0, 2, 6, 8)
    torch.library.opcheck(torch.ops.attn_export.attention.default, (q, k, v, None, None, False, None))
    q2, k2, v2 = (torch.randn(2, 2, n, 8, requires_grad=True) for n in (0, 6, 6))
    torch.library.opcheck(torch.ops.attn_export.attention.default, (q2, k2, v2, None, None, False, None))
