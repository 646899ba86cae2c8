"""Hand-written attention rewritten in the captured graph (attn_export.surgery.patterns):
exact matches become one attn_export::attention node (one FusedAttention ONNX node), everything
else is left alone with the reason. Every check compares against the untouched model."""
import math

import onnx
import pytest
import torch
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
        elif f == "masked_fill -100":
            s = (q @ k.transpose(-2, -1) / math.sqrt(d)).masked_fill(mask, -100.0)
        elif f == "einsum, -finfo.max, softmax in float32":  # x-transformers' Attend
            s = torch.einsum("b h i d, b h j d -> b h i j", q, k) * d ** -0.5
            s = s.masked_fill(mask, -torch.finfo(s.dtype).max)
            p = torch.softmax(s, dim=-1, dtype=torch.float32).type(q.dtype)
            return torch.einsum("b h i j, b h j d -> b h i d", self.drop(p), v)
        elif f == "einsum, token-major operands and output":
            s = torch.einsum("bihd,bjhd->bhij", q.transpose(1, 2), k.transpose(1, 2)) / math.sqrt(d)
            return torch.einsum("bhij,bjhd->bihd", torch.softmax(s + bias, -1), v.transpose(1, 2))
        elif f == "scale on q and k, float() around the softmax":  # Whisper without SDPA
            scale = d ** -0.25
            s = (q * scale) @ (k * scale).transpose(-1, -2) + bias
            w = torch.softmax(s.float(), dim=-1).to(q.dtype)
            return w @ v
        elif f == "where keep, finfo.min":  # GPT-2's eager attention
            s = torch.matmul(q, k.permute(0, 1, 3, 2)) / torch.full([], math.sqrt(d))
            s = torch.where(~mask, s, torch.full([], torch.finfo(s.dtype).min))
        elif f == "3-D bmm":
            b, h, l, _ = q.shape
            q3, k3, v3 = q.reshape(b * h, l, d), k.reshape(b * h, -1, d), v.reshape(b * h, k.size(2), -1)
            s = torch.bmm(q3, k3.transpose(1, 2)) * d ** -0.5
            p = torch.softmax(s.view(b, h, l, -1) + bias, -1).view(b * h, l, -1)
            return torch.bmm(p, v3).view(b, h, l, -1)
        elif f == "baddbmm beta=0 alpha=scale":  # diffusers' get_attention_scores
            b, h, l, _ = q.shape
            q3, k3, v3 = q.reshape(b * h, l, d), k.reshape(b * h, -1, d), v.reshape(b * h, k.size(2), -1)
            s = torch.baddbmm(torch.empty(b * h, l, k.size(2)), q3, k3.transpose(-1, -2), beta=0, alpha=d ** -0.5)
            return torch.bmm(torch.softmax(s, -1), v3).view(b, h, l, -1)
        elif f == "baddbmm with a bias":  # Bloom's ALiBi
            b, h, l, _ = q.shape
            q3, k3, v3 = q.reshape(b * h, l, d), k.reshape(b * h, -1, d), v.reshape(b * h, k.size(2), -1)
            alibi = bias.repeat(b, 1, 1)
            s = torch.baddbmm(alibi, q3, k3.transpose(-1, -2), beta=1.0, alpha=d ** -0.5)
            return torch.bmm(torch.softmax(s, -1), v3).view(b, h, l, -1)
        elif f == "grouped heads by repeat_interleave":
            kk, vv = k[:, :2].repeat_interleave(2, dim=1), v[:, :2].repeat_interleave(2, dim=1)
            return torch.softmax(q @ kk.transpose(-2, -1) / math.sqrt(d), -1) @ vv
        elif f == "grouped heads by expand and reshape":  # Llama's repeat_kv
            b, _, lk, _ = k.shape
            kk = k[:, :2, None].expand(b, 2, 2, lk, d).reshape(b, 4, lk, d)
            vv = v[:, :2, None].expand(b, 2, 2, lk, v.size(-1)).reshape(b, 4, lk, -1)
            return torch.softmax(q @ kk.transpose(-2, -1) / math.sqrt(d), -1) @ vv
        elif f == "one key head broadcast by matmul":
            return torch.softmax(q @ k[:, :1].transpose(-2, -1) / math.sqrt(d), -1) @ v[:, :1]
        elif f == "one key head in einsum":
            s = torch.einsum("bhid,bjd->bhij", q, k[:, 0]) / math.sqrt(d)
            return torch.einsum("bhij,bjd->bhid", torch.softmax(s, -1), v[:, 0])
        elif f == "two masks and a bias":
            s = (q @ k.transpose(-2, -1) / math.sqrt(d)) + bias
            s = s.masked_fill(mask, float("-inf")).masked_fill(mask.transpose(0, 1) & mask, -1e9)
        elif f == "row max subtracted by hand":  # the stable softmax some repositories write out
            s = q @ k.transpose(-2, -1) * d ** -0.5 + bias
            s = s - s.amax(dim=-1, keepdim=True).detach()
        elif f == "probabilities viewed to 3-D for bmm":
            b, h, l, _ = q.shape
            p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), -1).reshape(b * h, l, -1)
            return torch.bmm(p, v.reshape(b * h, k.size(2), -1)).view(b, h, l, -1)
        elif f == "values scaled":
            return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), -1) @ (v * 0.5)
        elif f == "scores minus the column max":
            s = q @ k.transpose(-2, -1)
            s = s - s.amax(dim=-2, keepdim=True)
        elif f == "scores scaled by a tensor":
            s = (q @ k.transpose(-2, -1)) * bias.sigmoid()
        elif f == "pre-softmax talking heads":
            s = q @ k.transpose(-2, -1) / math.sqrt(d)
            s = s + torch.einsum("bhij,hg->bgij", s, torch.eye(4) * 0.5)
        elif f == "post-softmax talking heads":
            p = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d), -1)
            return torch.einsum("bhij,hg->bgij", p, torch.eye(4) * 0.5) @ v
        elif f == "float64 softmax":
            s = q @ k.transpose(-2, -1)
            return torch.softmax(s.double(), -1).float() @ v
        elif f == "scale after bias":
            s = (q @ k.transpose(-2, -1) + bias) * 0.3
        elif f == "float64 inside":
            s = q.double() @ k.double().transpose(-2, -1)
            return (torch.softmax(s, dim=-1) @ v.double()).float()
        else:
            raise AssertionError(f)
        return self.drop(torch.softmax(s, dim=-1)) @ v


EXACT = ["mul right, bias, masked_fill", "div, bias on the left", "scale on q, permute",
         "mul left, masked_fill then bias", "no scale, two biases", "masked_fill -1e9",
         "einsum, -finfo.max, softmax in float32", "einsum, token-major operands and output",
         "scale on q and k, float() around the softmax", "where keep, finfo.min", "3-D bmm",
         "baddbmm beta=0 alpha=scale", "baddbmm with a bias", "grouped heads by repeat_interleave",
         "grouped heads by expand and reshape", "one key head broadcast by matmul", "one key head in einsum",
         "two masks and a bias", "row max subtracted by hand", "values scaled",
         "probabilities viewed to 3-D for bmm"]
LEFT_ALONE = {
    "softmax on axis -2": "softmax along axis -2, not the last",
    "weights also returned": "has 2 users",
    "masked_fill -100": "masked_fill of the scores with -100.0",
    "scale after bias": "aten.mul.Tensor by a constant after a bias or mask was added",
    "float64 inside": "dtype torch.float64",
    "scores scaled by a tensor": "aten.mul.Tensor by a tensor that is not a constant between the scores and the softmax",
    "pre-softmax talking heads":
        "aten.einsum.default of the scores is added to them (talking-heads attention",
    "post-softmax talking heads": "aten.einsum.default of the probabilities between the softmax and the values mixes "
                                  "them across heads (talking-heads attention",
    "float64 softmax": "a cast of the scores or probabilities to torch.float64",
    "scores minus the column max": "aten.sub.Tensor of a term computed from the scores themselves",
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
    pairs = zip(got, expected) if isinstance(got, tuple) else [(got, expected)]
    for g, e in pairs:
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


@pytest.mark.parametrize("fill, written_row", [(float("-inf"), "nan"), (-torch.finfo(torch.float32).max, "mean")])
def test_a_query_with_every_key_masked_gets_zeros(fill, written_row):
    """The one place a rewrite differs from the written graph: a row whose keys are all masked.
    The operator gives zeros; the graph gives NaN (-inf) or the mean of the values (a finite fill)."""

    class Masked(nn.Module):
        def forward(self, q, k, v, mask):
            s = (q @ k.transpose(-2, -1) * 0.3).masked_fill(mask, fill)
            return torch.softmax(s, -1) @ v

    q, k, v, _, mask = inputs()
    mask = mask.clone()
    mask[2] = True  # query 2 sees no key
    expected = Masked()(q, k, v, mask)
    exported = torch.export.export(Masked(), (q, k, v, mask), strict=False)
    assert [s.rewritten for s in rewrite(exported)] == [True]
    got = exported.module()(q, k, v, mask)
    keep = torch.arange(5) != 2
    assert_parity(got[:, :, keep], expected[:, :, keep], 2e-6, "the other rows")
    assert torch.equal(got[:, :, 2], torch.zeros_like(got[:, :, 2]))
    if written_row == "nan":
        assert expected[:, :, 2].isnan().all()
    else:
        assert_parity(expected[:, :, 2], v.mean(-2), 2e-6, "the written graph's row")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["scale on q and k, float() around the softmax",
                                  "einsum, -finfo.max, softmax in float32", "3-D bmm"])
def test_half_precision_rewrite_is_as_close_as_the_written_graph(form, dtype):
    """In half precision the rewrite's error against the float32 model is at most about that of
    the written graph run in the same precision (the casts around its softmax change rounding only)."""
    model = Written(form).eval()
    args32 = inputs()
    args = tuple(t.to(dtype) if t.dtype.is_floating_point else t for t in args32)
    reference = model(*args32)
    written = model(*args).float()
    exported = torch.export.export(model, args, strict=False)
    assert [s.rewritten for s in rewrite(exported)] == [True]
    fused = exported.module()(*args).float()
    own = float((written - reference).abs().max())
    err = float((fused - reference).abs().max())
    assert err <= 2 * own + 2 * torch.finfo(dtype).eps * float(reference.abs().max()), (err, own)


def test_dry_run_reports_without_changing_the_graph():
    model = Written("two masks and a bias").eval()
    exported = torch.export.export(model, inputs(), strict=False)
    before = [n.target for n in exported.graph.nodes]
    assert [s.rewritten for s in rewrite(exported, dry_run=True)] == [True]
    assert [n.target for n in exported.graph.nodes] == before
    refused = torch.export.export(Written("masked_fill -100").eval(), inputs(), strict=False)
    (site,) = rewrite(refused, dry_run=True)
    assert not site.rewritten and "masked_fill of the scores with -100.0" in site.reason
