"""Mixed precision with torch.autocast: the fused operators follow autocast's policy for
matmul-class ops (floating inputs cast to the region's dtype), so that a fused model trains under
autocast like the stock model. The reference is the stock module under the same autocast region,
both measured against float64 math: the fused layer may not be less accurate than it."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attn_export
from helpers import assert_within

DTYPE = torch.bfloat16


@pytest.mark.parametrize("self_attention", [True, False], ids=["self", "cross"])
def test_layer_under_autocast_matches_the_stock_layer(self_attention):
    torch.manual_seed(0)
    stock = nn.MultiheadAttention(64, 4, batch_first=True)
    fused = attn_export.FusedMultiheadAttention.from_module(copy.deepcopy(stock))
    exact = copy.deepcopy(stock).double()
    x = torch.randn(3, 10, 64)
    memory = x if self_attention else torch.randn(3, 7, 64)
    padding = torch.zeros(3, memory.size(1), dtype=torch.bool)
    padding[1, -3:] = True

    outputs, grads = {}, {}
    for name, module in (("stock", stock), ("fused", fused)):
        with torch.autocast("cpu", dtype=DTYPE):
            out, weights = module(x, memory, memory, key_padding_mask=padding)
        assert out.dtype == DTYPE, name
        out.float().square().sum().backward()
        outputs[name] = (out, weights)
        grads[name] = {n: p.grad for n, p in module.named_parameters()}
        assert all(g.dtype == torch.float32 for g in grads[name].values()), name

    ref_out, ref_weights = exact(x.double(), memory.double(), memory.double(), key_padding_mask=padding)
    ref_out.square().sum().backward()
    for i, (reference, what) in enumerate(((ref_out, "output"), (ref_weights, "weights"))):
        assert not torch.equal(outputs["fused"][i].double(), reference), f"{what}: not computed in {DTYPE}"
        assert_within(outputs["fused"][i], outputs["stock"][i], reference, DTYPE, what)
    exact_grads = [p.grad for p in exact.parameters()]  # the parameter gradients' common scale
    for n, p in exact.named_parameters():
        assert_within(grads["fused"][n], grads["stock"][n], p.grad, DTYPE, f"grad {n}", scale=exact_grads)


def test_attention_core_under_autocast_matches_sdpa():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=DTYPE):
        fused = attn_export.attention(q, k, v, is_causal=True)
        stock = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert fused.dtype == stock.dtype == DTYPE
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert_within(fused, stock, reference, DTYPE, "output")
    (grad_q,) = torch.autograd.grad(fused.float().sum(), q)
    assert grad_q.dtype == torch.float32


def test_outside_autocast_nothing_is_cast():
    layer = attn_export.FusedMultiheadAttention(32, 2, batch_first=True)
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=DTYPE, enabled=False):
        out, _ = layer(x, x, x)
    assert out.dtype == torch.float32
    # float64 is never lowered, as in autocast's own policy
    layer64 = copy.deepcopy(layer).double()
    with torch.autocast("cpu", dtype=DTYPE):
        out64, _ = layer64(x.double(), x.double(), x.double())
    assert out64.dtype == torch.float64
