"""ALiBi slopes on the FusedAttention node (attribute ``alibi_slopes``, FLOATS): the function bodies
(generic and lean) and the standard flavor's rewrite in ONNX Runtime against the float64 reference
of tests/helpers.py (the bias -m[h] * |i + Lk - Lq - j| written there with torch.arange), and
``attn_export.attention(..., alibi_slopes=...)`` exported in the custom and the standard flavors
against PyTorch."""
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import attn_export
from attn_export import CausalAlignment, spec
from attn_export.inputs import resize
from attn_export.onnx import attention_flavor, export_onnx
from attn_export.onnx import node as onnx_node
from helpers import assert_parity, reference_attention
from test_onnx_node import BODIES, additive, one_node_model, pack
from test_onnx_standard import standard_model

S = spec.load()
SLOPES = [2 ** -1, 2 ** -2, 2 ** -3, 2 ** -4, 2 ** -0.5, 2 ** -1.5]  # Bloom's and MPT's set for 6 heads


def run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def case(lengths, kv_heads, padded):
    """q [2, 6, Lq, 4], k/v [2, kv_heads, Lk, 4 / 6], and a left padding of batch row 1 (``padded``)."""
    Lq, Lk = lengths
    torch.manual_seed(Lq * 100 + Lk + kv_heads)
    q, k, v = torch.randn(2, 6, Lq, 4), torch.randn(2, kv_heads, Lk, 4), torch.randn(2, kv_heads, Lk, 6)
    padding = None
    if padded:
        padding = torch.zeros(2, Lk, dtype=torch.bool)
        padding[1, : Lk // 2] = True
    return q, k, v, padding


def feeds(q, k, v, padding):
    return {"query": pack(q), "key": pack(k), "value": pack(v),
            "key_padding_mask": additive(padding).numpy() if padding is not None else np.zeros((1, 1), np.float32),
            "attn_mask": np.zeros((1, 1, 1, 1), np.float32)}


def expected(q, k, v, padding, slopes, **kwargs):
    ref, _ = reference_attention(q, k, v, key_padding_mask=padding, alibi_slopes=slopes, scale=0.5, **kwargs)
    return ref.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1).numpy()


# (causal, causal_alignment, key/value heads, Lq x Lk, padded): a decode step and a chunk over a
# longer cache, Lq > Lk, grouped-query heads, both alignments.
CASES = [(False, 0, 6, (5, 5), False), (True, 1, 2, (1, 9), True), (True, 0, 3, (4, 9), False),
         (True, 1, 6, (6, 9), True), (False, 0, 1, (7, 4), True)]


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("causal, alignment, kv_heads, lengths, padded", CASES)
def test_the_bodies_add_the_alibi_bias(body, causal, alignment, kv_heads, lengths, padded):
    q, k, v, padding = case(lengths, kv_heads, padded)
    attrs = onnx_node.node_attributes(6, 0.5, causal, padded, False, causal_alignment=alignment,
                                      kv_num_heads=kv_heads, alibi_slopes=SLOPES)
    model = one_node_model(attrs, body=body)
    onnx.checker.check_model(model, full_check=True)
    out = run(model, feeds(q, k, v, padding))
    want = expected(q, k, v, padding, SLOPES, is_causal=causal, causal_alignment=alignment)
    assert_parity(out, want, 2e-6)
    plain = expected(q, k, v, padding, None, is_causal=causal, causal_alignment=alignment)
    if lengths[1] > 1 and not (causal and alignment == 0 and lengths[0] == 1):
        assert np.abs(out - plain).max() > 1e-2  # the bias is there


@pytest.mark.parametrize("body", BODIES)
def test_no_slopes_is_no_alibi(body):
    """The generic body reads an empty list as no ALiBi (it adds -0); the lean body of a node without
    slopes has no ALiBi step at all."""
    q, k, v, padding = case((5, 8), 3, True)
    model = one_node_model(onnx_node.node_attributes(6, 0.5, True, True, False, kv_num_heads=3), body=body)
    out = run(model, feeds(q, k, v, padding))
    assert_parity(out, expected(q, k, v, padding, None, is_causal=True), 2e-6)
    ops = {n.op_type for f in model.functions for n in f.node}
    assert ("Range" in ops) == (body == "generic")
    # Not written without slopes: the node is what version 5 wrote (the bodies default to the empty list).
    for none in (None, []):
        assert S.attr_alibi_slopes not in onnx_node.node_attributes(6, 0.5, False, False, False, alibi_slopes=none)


def test_the_lean_variant_is_named_after_its_slopes():
    node = onnx.helper.make_node(S.op_type, list(S.input_names), ["out"], domain=S.domain,
                                 **onnx_node.node_attributes(6, 0.5, True, False, False, alibi_slopes=SLOPES))
    variant = onnx_node.BodyVariant.of_node(node, onnx.TensorProto.FLOAT)
    assert variant.alibi and variant.name == "f32_causal_alibi"


@pytest.mark.parametrize("slopes, words", [
    ([0.5] * 5, "have one slope per query head \\(num_heads = 6\\); got 5"),
    ([0.5] * 5 + [math.nan], "be finite float32 numbers; got nan for head 5"),
    ([1e39] + [0.5] * 5, "be finite float32 numbers; got 1e\\+39 for head 0"),
])
def test_node_attributes_refuse_bad_slopes(slopes, words):
    with pytest.raises(ValueError, match=f"alibi_slopes must {words}"):
        onnx_node.node_attributes(6, 0.5, False, False, False, alibi_slopes=slopes)


@pytest.mark.parametrize("causal, alignment, kv_heads, lengths, padded", CASES)
def test_the_standard_rewrite_adds_the_bias_to_the_mask(causal, alignment, kv_heads, lengths, padded):
    q, k, v, padding = case(lengths, kv_heads, padded)
    attrs = onnx_node.node_attributes(6, 0.5, causal, padded, False, causal_alignment=alignment,
                                      kv_num_heads=kv_heads, alibi_slopes=SLOPES)
    model, rewrite = standard_model(attrs)
    assert rewrite.converted == 1 and attention_flavor(model)["flavor"] == "standard"
    out = run(model, feeds(q, k, v, padding))
    assert_parity(out, expected(q, k, v, padding, SLOPES, is_causal=causal, causal_alignment=alignment), 2e-6)


def test_the_standard_rewrite_keeps_slopes_with_a_softcap_custom():
    attrs = onnx_node.node_attributes(6, 0.5, False, False, False, softcap=5.0, alibi_slopes=SLOPES)
    _, rewrite = standard_model(attrs)
    assert rewrite.converted == 0 and "ALiBi" in rewrite.kept[0]


class AlibiModel(nn.Module):
    """A decoder step's attention core with MPT's slopes for 4 heads, bottom-right causal."""

    def forward(self, q, k, v, key_padding_mask):
        return attn_export.attention(q, k, v, key_padding_mask=key_padding_mask, is_causal=True,
                                     causal_alignment=CausalAlignment.BOTTOM_RIGHT,
                                     alibi_slopes=[2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])


@pytest.mark.slow
@pytest.mark.parametrize("flavor", ["custom", "standard"])
def test_exported_slopes_run_in_onnx_runtime_as_in_pytorch(tmp_path, flavor):
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, :2] = True
    inputs = {"q": q, "k": k, "v": v, "key_padding_mask": pad}
    axes = {"q": {0: "batch", 2: "lq"}, "k": {0: "batch", 2: "lk"}, "v": {0: "batch", 2: "lk"},
            "key_padding_mask": {0: "batch", 1: "lk"}}
    result = export_onnx(AlibiModel(), inputs, tmp_path / f"{flavor}.onnx", dynamic_axes=axes, replace=False,
                         attention=flavor)
    model = onnx.load(str(result.path))
    onnx.checker.check_model(model, full_check=True)
    assert attention_flavor(model)["flavor"] == flavor
    if flavor == "custom":
        (node,) = [n for n in model.graph.node if n.op_type == S.op_type]
        slopes = onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == S.attr_alibi_slopes))
        assert slopes == pytest.approx([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    for shapes in ({"batch": 2, "lq": 3, "lk": 7}, {"batch": 3, "lq": 1, "lk": 11}):
        other = resize(inputs, axes, shapes, seed=4)
        (out,) = session.run(None, {i.name: other[i.name].numpy() for i in session.get_inputs()})
        torch_out = AlibiModel()(**other)
        assert_parity(out, torch_out.numpy(), 2e-6, f"{flavor} {shapes}")
        exact, _ = reference_attention(other["q"], other["k"], other["v"], key_padding_mask=other["key_padding_mask"],
                                       is_causal=True, causal_alignment=1,
                                       alibi_slopes=[2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
        assert_parity(out, exact.numpy(), 2e-6, f"{flavor} {shapes} against float64")


@pytest.mark.parametrize("flavor", ["custom", "standard"])
@pytest.mark.parametrize("past, new", [(4, 3), (6, 1)], ids=["prefill-after-past", "decode"])
def test_slopes_over_a_folded_cache(flavor, past, new):
    """The cache folded into the node (custom: its cache form; standard: Attention's past inputs):
    the distance runs over the present, Lk = P + S, the new tokens bottom-right."""
    from attn_export.onnx import to_standard_attention
    from attn_export.onnx.custom_past import fold_past
    from attn_export.onnx.graph import attach_function
    from test_with_past import cached_node_model

    B, H, Hkv, D = 2, 4, 2, 8
    slopes = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    attrs = onnx_node.node_attributes(H, 0.3, True, True, False, causal_alignment=1, kv_num_heads=Hkv,
                                      alibi_slopes=slopes)
    model = cached_node_model(attrs, H, Hkv, D)
    if flavor == "custom":
        del model.functions[:]
        assert fold_past(model) == 1
        attach_function(model, 23)
    else:
        assert to_standard_attention(model).converted == 1
    onnx.checker.check_model(model, full_check=True)
    assert any("past_key" in n.input and n.op_type in (S.op_type, "Attention") for n in model.graph.node)

    gen = torch.Generator().manual_seed(past * 10 + new)
    q = torch.randn(B, H, new, D, generator=gen)
    k_past, v_past, k_new, v_new = (torch.randn(B, Hkv, n, D, generator=gen) for n in (past, past, new, new))
    masked = torch.zeros(B, past + new, dtype=torch.bool)
    masked[1, :2] = True  # left padding of the second sequence
    feeds = {"query": q.transpose(1, 2).reshape(B, new, H * D), "past_key": k_past, "new_key": k_new,
             "past_value": v_past, "new_value": v_new, "key_padding_mask": torch.where(masked, float("-inf"), 0.0)}
    out = run(model, {n: t.numpy() for n, t in feeds.items()})
    ref, _ = reference_attention(q, torch.cat([k_past, k_new], 2), torch.cat([v_past, v_new], 2),
                                 key_padding_mask=masked, is_causal=True, causal_alignment=1, scale=0.3,
                                 alibi_slopes=slopes)
    assert_parity(out, ref.transpose(1, 2).reshape(B, new, H * D).numpy(), 2e-6)
