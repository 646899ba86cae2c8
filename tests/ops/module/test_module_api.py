"""FusedMultiheadAttention as a drop-in: constructor, state_dict, from_module, dropout."""
import copy

import pytest
import torch
from torch import nn

from attn_export import FusedMultiheadAttention
from helpers import assert_rel_close, make_pair


def test_state_dict_keys_and_shapes_match_nn_multihead_attention():
    for bias in (True, False):
        ref = nn.MultiheadAttention(32, 4, bias=bias)
        fused = FusedMultiheadAttention(32, 4, bias=bias)
        assert {k: v.shape for k, v in fused.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


def test_state_dict_loads_both_ways_and_gives_the_same_outputs():
    ref = nn.MultiheadAttention(32, 4, batch_first=True)
    fused = FusedMultiheadAttention(32, 4, batch_first=True)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 32)
    assert_rel_close(fused(x, x, x)[0], ref(x, x, x)[0], 2e-6, "after loading into fused")
    fused2 = FusedMultiheadAttention(32, 4, batch_first=True)
    ref.load_state_dict(fused2.state_dict())
    assert_rel_close(fused2(x, x, x)[0], ref(x, x, x)[0], 2e-6, "after loading into stock")


def test_positional_constructor_matches_nn_multihead_attention():
    # embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first
    fused = FusedMultiheadAttention(16, 2, 0.0, False, False, False, None, None, True, dtype=torch.float64)
    assert fused.batch_first and fused.in_proj_bias is None and fused.in_proj_weight.dtype == torch.float64


def test_initialization_follows_nn_multihead_attention():
    fused = FusedMultiheadAttention(64, 4)
    assert torch.equal(fused.in_proj_bias, torch.zeros(192))
    assert torch.equal(fused.out_proj.bias, torch.zeros(64))
    bound = (6 / (64 + 192)) ** 0.5  # xavier_uniform on [3E, E]
    assert fused.in_proj_weight.abs().max() <= bound


def test_from_module_shares_parameters_and_mode():
    ref = nn.MultiheadAttention(16, 2).eval()
    fused = FusedMultiheadAttention.from_module(ref)
    assert fused.in_proj_weight is ref.in_proj_weight
    assert fused.out_proj.weight is ref.out_proj.weight
    assert not fused.training
    assert {n for n, _ in fused.named_parameters()} == {n for n, _ in ref.named_parameters()}


@pytest.mark.parametrize(
    "kwargs",
    [{"add_bias_kv": True}, {"add_zero_attn": True}, {"kdim": 8, "vdim": 8}, {"kdim": 8}, {"vdim": 12, "bias": False}],
)
def test_every_stock_configuration_constructs_and_converts(kwargs):
    """Configurations the layer operator does not cover run on the core operator; none is refused."""
    ref = nn.MultiheadAttention(16, 2, **kwargs)
    fused = FusedMultiheadAttention.from_module(ref)
    built = FusedMultiheadAttention(16, 2, **kwargs)
    for layer in (fused, built):
        for name in ("_qkv_same_embed_dim", "kdim", "vdim", "add_zero_attn", "head_dim"):
            assert getattr(layer, name) == getattr(ref, name), name
        assert (layer.bias_k is None) == (ref.bias_k is None)
        assert {k: v.shape for k, v in layer.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    assert fused.q_proj_weight is ref.q_proj_weight and fused.bias_k is ref.bias_k


@pytest.mark.parametrize("embed_dim, num_heads", [(10, 3), (0, 2), (8, 0), (-4, 2)])
def test_constructor_rejects_bad_geometry_as_the_stock_module_does(embed_dim, num_heads):
    with pytest.raises(Exception) as stock:
        nn.MultiheadAttention(embed_dim, num_heads)
    with pytest.raises(type(stock.value)) as fused:
        FusedMultiheadAttention(embed_dim, num_heads)
    assert type(fused.value) is type(stock.value) and str(fused.value) == str(stock.value)


def test_dropout_in_training_uses_the_reference_path_with_the_same_randomness():
    ref, fused = make_pair(16, 2, batch_first=True)
    ref.dropout = fused.dropout = 0.5
    ref.train(), fused.train()
    x = torch.randn(2, 6, 16)
    torch.manual_seed(7)
    out_ref, w_ref = ref(x, x, x)
    torch.manual_seed(7)
    out, w = fused(x, x, x)
    assert_rel_close(out, out_ref, 1e-6, "dropout output")
    assert_rel_close(w, w_ref, 1e-6, "dropout weights")
    fused.eval(), ref.eval()
    assert_rel_close(fused(x, x, x)[0], ref(x, x, x)[0], 2e-6, "eval ignores dropout")


def test_dropout_path_accepts_is_causal_without_a_mask():
    fused = FusedMultiheadAttention(16, 2, dropout=0.1, batch_first=True).train()
    out, _ = fused(torch.randn(2, 5, 16), torch.randn(2, 5, 16), torch.randn(2, 5, 16), is_causal=True)
    assert out.shape == (2, 5, 16)


def test_works_inside_transformer_encoder_layer():
    layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    x = torch.randn(3, 7, 32)
    expected = layer(x)
    layer.self_attn = FusedMultiheadAttention.from_module(layer.self_attn)
    assert_rel_close(layer(x), expected, 5e-6, "encoder layer output")


def test_need_weights_false_returns_none():
    fused = FusedMultiheadAttention(16, 2)
    x = torch.randn(4, 2, 16)
    out, w = fused(x, x, x, need_weights=False)
    assert w is None and out.shape == x.shape and out.is_contiguous()


def test_parameters_are_contiguous_in_the_stock_layout_and_gradients_follow():
    """FSDP2 refuses non-contiguous parameters, and DDP buckets and optimizers assume the
    stock layout: every parameter is laid out as nn.MultiheadAttention's is, from_module leaves
    the shared ones untouched, and gradients come back in the same layout (autograd then
    accumulates them without a copy)."""
    fused = FusedMultiheadAttention(32, 4, batch_first=True)
    separate = FusedMultiheadAttention(32, 4, kdim=16, vdim=24, add_bias_kv=True, batch_first=True)
    ref = nn.MultiheadAttention(32, 4, batch_first=True)
    strides = {name: p.stride() for name, p in ref.named_parameters()}
    shared = FusedMultiheadAttention.from_module(ref)
    stock_layouts = {
        name: (p.shape, p.stride())
        for name, p in nn.MultiheadAttention(32, 4, kdim=16, vdim=24, add_bias_kv=True).named_parameters()
    }
    assert {name: (p.shape, p.stride()) for name, p in separate.named_parameters()} == stock_layouts
    assert {name: p.stride() for name, p in shared.named_parameters()} == strides
    for layer in (fused, shared):
        x = torch.randn(2, 5, 32)
        layer(x, x, x)[0].sum().backward()
        for name, p in layer.named_parameters():
            assert p.is_contiguous() and p.grad.stride() == p.stride(), name
    assert shared.in_proj_weight is ref.in_proj_weight


def test_opcheck_backward_with_column_major_weights():
    E, H = 8, 2
    x = torch.randn(2, 5, E)
    w_in = torch.randn(E, 3 * E).t()
    w_out = torch.randn(E, E).t()
    b_in, b_out = torch.randn(3 * E), torch.randn(E)
    ops = torch.ops.attn_export
    args = (x, x, x, H, w_in, b_in, w_out, b_out, None, None, False, True, False, True)
    _, _, q_proj, kv_proj, attn, lse = ops._multi_head_attention_forward(*args, True)
    torch.library.opcheck(
        ops._multi_head_attention_backward.default,
        (torch.randn_like(x), None, *args, True, False, q_proj, kv_proj, attn, lse, [True] * 7),
    )
