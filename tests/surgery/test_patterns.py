"""Hand-written attention rewritten in the captured graph (attn_export.surgery.patterns):
exact matches become one attn_export::attention node (one FusedAttention ONNX node), everything
else is left alone with the reason. Every check compares against the untouched model."""
import math

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attn_export
from attn_export import spec
from attn_export.onnx import export_onnx
from attn_export.surgery.patterns import rewrite

import sdpa_models as M
from helpers import assert_parity

S = spec.load()


def op_types(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node]


class Written(nn.Module):
    """One hand-written attention, in one of the spellings seen in model code."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.drop = nn.Dropout(0.1)

    def forward(self, q, k, v, bias, mask):
        d = q.size(-1)
        f = self.form
        if f == "mul right, bias, masked_fill":
            s = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d)) + bias
            s = s.masked_fill(mask, float("-inf"))
        elif f == "div, bias on the left":
            s = bias + torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        elif f == "scale on q, permute":
            s = (q * d ** -0.5).matmul(k.permute(0, 1, 3, 2))
        elif f == "mul left, masked_fill then bias":
            s = (0.25 * (q @ k.transpose(-2, -1))).masked_fill(mask, float("-inf")) + bias
        elif f == "no scale, two biases":
            s = q @ k.transpose(-2, -1) + bias + bias.transpose(-1, -2)
        elif f == "softmax on axis -2":
            return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-2) @ v
        elif f == "weights also returned":
            p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), dim=-1)
            return p @ v, p
        elif f == "masked_fill -1e9":
            s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(mask, -1e9)
        elif f == "scale after bias":
            s = (q @ k.transpose(-2, -1) + bias) * 0.3
        elif f == "float64 inside":
            s = q.double() @ k.double().transpose(-2, -1)
            return (torch.softmax(s, dim=-1) @ v.double()).float()
        else:
            raise AssertionError(f)
        return self.drop(torch.softmax(s, dim=-1)) @ v


EXACT = ["mul right, bias, masked_fill", "div, bias on the left", "scale on q, permute",
         "mul left, masked_fill then bias", "no scale, two biases"]
LEFT_ALONE = {
    "softmax on axis -2": "not the last",
    "weights also returned": "users",
    "masked_fill -1e9": "only -inf is exact",
    "scale after bias": "between the scores and the softmax",
    "float64 inside": "dtype torch.float64",
}


def inputs(lq=5, lk=5):
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(lq, lk, dtype=torch.bool).triu(1)  # causal: no row fully masked
    return (torch.randn(2, 4, lq, 8, generator=g), torch.randn(2, 4, lk, 8, generator=g),
            torch.randn(2, 4, lk, 6, generator=g), torch.randn(4, lq, lk, generator=g), mask)


@pytest.mark.parametrize("form", EXACT + list(LEFT_ALONE))
def test_rewrite_is_exact_or_not_done(form):
    model = Written(form).eval()
    args = inputs()
    expected = model(*args)
    exported = torch.export.export(model, args, strict=False)
    sites = rewrite(exported)
    assert len(sites) == 1
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    fused = targets.count(torch.ops.attn_export.attention.default)
    got = exported.module()(*args)
    if form in EXACT:
        assert sites[0].rewritten and fused == 1, sites[0].reason
        assert torch.ops.aten.softmax.int not in targets
    else:
        assert not sites[0].rewritten and fused == 0
        assert LEFT_ALONE[form] in sites[0].reason, sites[0].reason
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        assert_parity(g, e, 2e-6, form)


def test_softmax_that_is_no_attention_is_not_a_site():
    class Classifier(nn.Module):
        def forward(self, x):
            return torch.softmax(x @ x.transpose(-1, -2), -1).sum(-1)

    exported = torch.export.export(Classifier(), (torch.randn(2, 3, 4),), strict=False)
    assert rewrite(exported) == []


@pytest.mark.parametrize("factory, sites, axes", [
    ("nanogpt_manual", 2, None),
    ("bert_style", 1, None),
    ("swin_stage", 2, {"x": {0: "batch"}}),
])
def test_models_export_one_node_per_site_and_validate(tmp_path, factory, sites, axes):
    """nanoGPT's non-flash attention (causal masked_fill), BERT-style additive padding, and
    torchvision's shifted-window attention (relative-position bias + the shift mask added through a
    5-D view), with dynamic batch (and sequence where the model allows)."""
    model = getattr(M, factory)()
    plan = attn_export.inspect_attention(model)
    assert len(plan.layers) == sites and all(layer.status == "skipped" for layer in plan.layers)
    result = export_onnx(model, model.example_inputs, tmp_path / "m.onnx", dynamic_axes=axes)
    assert result.num_attention_nodes == sites
    types = op_types(result.path)
    assert types.count(S.op_type) == sites and "Softmax" not in types
    assert [(layer.found, layer.status) for layer in result.replacement.layers] == \
        [("pattern", "rewritten in the export")] * sites
    assert result.replacement.coverage_error(require_all=True) is None
    check = attn_export.validate(model, result.path, model.example_inputs, dynamic_axes=axes)
    assert check.passed, check.failures


def test_left_alone_pattern_is_reported_and_exported_unchanged(tmp_path):
    class ReturnsWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attention = Written("weights also returned")

        def forward(self, q, k, v):
            return self.self_attention(q, k, v, None, None)

    q, k, v, _, _ = inputs()
    model = ReturnsWeights().eval()
    result = export_onnx(model, {"q": q, "k": k, "v": v}, tmp_path / "w.onnx",
                         dynamic_axes={"q": {0: "batch"}, "k": {0: "batch"}, "v": {0: "batch"}})
    assert result.num_attention_nodes == 0 and "Softmax" in op_types(result.path)
    (layer,) = result.replacement.layers
    assert layer.found == "pattern" and layer.status == "skipped" and "users" in layer.reason
    check = attn_export.validate(model, result.path, {"q": q, "k": k, "v": v},
                                 dynamic_axes={"q": {0: "batch"}, "k": {0: "batch"}, "v": {0: "batch"}})
    assert check.passed, check.failures
