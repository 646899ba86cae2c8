"""The SDPA route (attn_export.surgery.routes.sdpa; its parts in attn_export.surgery.sdpa):
F.scaled_dot_product_attention calls inside a model run on the fused operator, with SDPA's exact
semantics, in eager (inference and training with gradients), through torch.export and into ONNX
(one FusedAttention node per call); whatever the operator cannot express stays on PyTorch's SDPA
and says why. Every check compares against the untouched model."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attn_export
from attn_export.surgery import sdpa
from attn_export.surgery.replace import ALREADY_FUSED, ROUTED, SKIPPED, WILL_ROUTE, inspect_attention, replace_attention

import sdpa_models as M
from helpers import assert_parity, max_rel_err

EPS = {torch.float32: torch.finfo(torch.float32).eps, torch.float16: torch.finfo(torch.float16).eps,
       torch.bfloat16: torch.finfo(torch.bfloat16).eps}
FP32_REL = 2e-6


class Call(nn.Module):
    """forward = one SDPA call with fixed keyword arguments."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kw)


def routed(model):
    copy_ = copy.deepcopy(model)
    replace_attention(copy_)
    return copy_


B, H, L, S, D, DV = 2, 4, 5, 7, 8, 6


def qkv(lq=L, lk=S, heads=H, kv_heads=H, rank=4, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(lq * 100 + lk)
    shape = (lambda h, l, d: (B, h, l, d)) if rank == 4 else (lambda h, l, d: (B, l, d))
    out = [torch.randn(shape(heads, lq, D), generator=g), torch.randn(shape(kv_heads, lk, D), generator=g),
           torch.randn(shape(kv_heads, lk, DV), generator=g)]
    return [t.to(dtype).requires_grad_(grad) for t in out]


def bool_mask(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(shape, generator=g) > 0.4
    mask[..., 0] = True  # every query sees a key: SDPA's output is defined (no NaN rows)
    return mask


CASES = {
    # name: (q/k/v kwargs, mask, SDPA kwargs)
    "plain": ({}, None, {}),
    "causal Lq<Lk": ({}, None, {"is_causal": True}),
    "causal Lq>Lk": ({"lq": 9}, None, {"is_causal": True}),
    "causal Lq=Lk": ({"lq": S}, None, {"is_causal": True}),
    "scale": ({}, None, {"scale": 0.37}),
    "bool [Lq,Lk]": ({}, bool_mask(L, S), {}),
    "bool [B,1,1,Lk] padding": ({}, bool_mask(B, 1, 1, S, seed=1), {}),
    "bool [1,Lk] padding": ({}, bool_mask(1, S, seed=2), {}),
    "bool [B,H,Lq,Lk]": ({}, bool_mask(B, H, L, S, seed=3), {}),
    "float [H,Lq,Lk] bias": ({}, torch.randn(H, L, S), {}),
    "float [B,1,Lq,1]": ({}, torch.randn(B, 1, L, 1), {}),
    "float [1,H,1,Lk] with -inf": ({}, torch.randn(1, H, 1, S).masked_fill(bool_mask(1, H, 1, S, seed=4).logical_not(),
                                                                           -math.inf), {}),
    "gqa causal": ({"kv_heads": 2}, None, {"is_causal": True, "enable_gqa": True}),
    "gqa bool mask": ({"kv_heads": 1}, bool_mask(B, 1, L, S, seed=5), {"enable_gqa": True}),
    "3-D": ({"rank": 3}, None, {}),
    "3-D causal": ({"rank": 3, "lq": S}, None, {"is_causal": True}),
    "3-D float [B,Lq,Lk]": ({"rank": 3}, torch.randn(B, L, S), {}),
    "3-D bool [Lq,Lk]": ({"rank": 3}, bool_mask(L, S, seed=6), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_semantics_match_sdpa(case):
    shapes, mask, kw = CASES[case]
    q, k, v = qkv(**shapes)
    model = Call(**kw)
    expected = model(q, k, v, mask)
    fused = routed(model)
    out = fused(q, k, v, mask)
    assert sdpa.call_counter(fused) == {"fused": 1}
    assert out.shape == expected.shape
    assert_parity(out, expected, FP32_REL)


@pytest.mark.parametrize("case,kv_heads", [("gqa causal", 2), ("gqa bool mask", 1)])
def test_grouped_key_value_heads_reach_the_operator_unrepeated(case, kv_heads, monkeypatch):
    """enable_gqa calls hand the operator key/value with their own heads (it groups them): no
    repeated copy of K/V, in eager mode or in an exported graph."""
    import attn_export.ops.functional as ops

    seen, original = [], ops.attention

    def spy(query, key, value, *args, **kwargs):
        seen.append((query.shape[1], key.shape[1], value.shape[1]))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(ops, "attention", spy)
    shapes, mask, kw = CASES[case]
    fused = routed(Call(**kw))
    fused(*qkv(**shapes), mask)
    assert seen == [(H, kv_heads, kv_heads)]


@pytest.mark.parametrize("case", ["causal Lq>Lk", "gqa causal", "bool [B,1,1,Lk] padding", "3-D float [B,Lq,Lk]"])
def test_gradients_match_sdpa(case):
    shapes, mask, kw = CASES[case]
    inputs = qkv(**shapes, grad=True)
    model = Call(**kw).train()
    fused = routed(model)
    grad_out = torch.randn_like(model(*inputs, mask))
    expected = torch.autograd.grad(model(*inputs, mask), inputs, grad_out)
    got = torch.autograd.grad(fused(*inputs, mask), inputs, grad_out)
    assert sdpa.call_counter(fused) == {"fused": 1}
    for name, g, e in zip("qkv", got, expected):
        assert_parity(g, e, 4 * FP32_REL, f"grad {name}", scale=expected)  # the input gradients' scale


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["causal Lq>Lk", "gqa bool mask", "float [H,Lq,Lk] bias"])
def test_half_precision_within_sdpas_own_error(case, dtype):
    """The fused result's error against a float64 reference is at most ~2x that of PyTorch's
    SDPA run in the same half type (plus a few ulps)."""
    shapes, mask, kw = CASES[case]
    q, k, v = qkv(**shapes)
    model = Call(**kw)
    reference = model(q.double(), k.double(), v.double(), None if mask is None or mask.dtype == torch.bool
                      else mask.double()) if mask is None or mask.dtype != torch.bool else \
        model(q.double(), k.double(), v.double(), mask)
    low = [t.to(dtype) for t in (q, k, v)]
    low_mask = mask if mask is None or mask.dtype == torch.bool else mask.to(dtype)
    stock_err = max_rel_err(model(*low, low_mask), reference)
    fused = routed(model)
    fused_err = max_rel_err(fused(*low, low_mask), reference)
    assert sdpa.call_counter(fused) == {"fused": 1}
    assert fused_err <= 2 * stock_err + 4 * EPS[dtype], (fused_err, stock_err)


def test_stock_sdpa_keeps_what_the_operator_cannot_express():
    q, k, v = qkv()
    cases = [
        (Call(dropout_p=0.5), None, "dropout_p=0.5"),
        (Call(is_causal=True), bool_mask(L, S), "attn_mask together with is_causal"),
        (Call(), None, "without enable_gqa"),  # heads differ
    ]
    for model, mask, words in cases:
        fused = routed(model)
        kv_heads = 2 if words == "without enable_gqa" else H
        q, k, v = qkv(kv_heads=kv_heads)
        torch.manual_seed(0)
        try:
            expected = model(q, k, v, mask)
        except RuntimeError:
            expected = None
        torch.manual_seed(0)
        try:
            out = fused(q, k, v, mask)
        except RuntimeError:
            out = None
        assert (out is None) == (expected is None), words
        if out is not None:
            assert torch.equal(out, expected), words
        (key,) = sdpa.call_counter(fused)
        assert key.startswith("stock: ") and words in key, key


def test_mask_requiring_grad_stays_on_sdpa_in_training_and_is_fused_without_grad():
    bias = nn.Parameter(torch.randn(H, L, S))
    q, k, v = qkv()
    model = Call()
    fused = routed(model)
    out = fused(q, k, v, bias)
    assert torch.equal(out, model(q, k, v, bias))
    assert list(sdpa.call_counter(fused)) == ["stock: attn_mask requires grad (the operator treats masks as constants)"]
    out.sum().backward()
    assert bias.grad is not None  # the stock path keeps the mask's gradient
    with torch.no_grad():
        assert_parity(fused(q, k, v, bias), model(q, k, v, bias), FP32_REL)
    assert sdpa.call_counter(fused)["fused"] == 1


def test_fully_masked_rows_give_zeros():
    """A query that sees no key (boolean mask all False) gets zeros from the operator, never
    NaN (some SDPA backends return NaN there; docs/attention_sites.md)."""
    q, k, v = qkv()
    mask = bool_mask(L, S)
    mask[2] = False
    fused = routed(Call())
    out = fused(q, k, v, mask)
    assert torch.isfinite(out).all() and (out[:, :, 2] == 0).all()
    expected = Call()(q, k, v, mask)
    rows = [0, 1, 3, 4]
    assert_parity(out[:, :, rows], expected[:, :, rows], FP32_REL)


# -- discovery and the report ------------------------------------------------------------------

def _helper_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


class ViaHelper(nn.Module):
    def forward(self, q, k, v):
        return _helper_sdpa(q, k, v) * 2


class ViaMethod(nn.Module):
    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    def forward(self, q, k, v):
        return self.attend(q, k, v) + 1


class NoAttention(nn.Module):
    def forward(self, x):
        return torch.softmax(x, -1)


def test_sites_are_found_in_forward_helpers_and_methods():
    assert sdpa.calls_sdpa(Call()) and sdpa.calls_sdpa(ViaHelper()) and sdpa.calls_sdpa(ViaMethod())
    assert not sdpa.calls_sdpa(NoAttention()) and not sdpa.calls_sdpa(nn.MultiheadAttention(8, 2))
    assert not sdpa.calls_sdpa(nn.TransformerEncoderLayer(8, 2))
    q, k, v = qkv(kv_heads=H)
    for model in (ViaHelper(), ViaMethod()):
        fused = routed(model)
        assert_parity(fused(q, k, v), model(q, k, v), FP32_REL)
        assert sdpa.call_counter(fused) == {"fused": 1}


def test_report_lists_every_site_with_how_it_was_found():
    model = M.whisper_like()
    plan = inspect_attention(model)
    sites = [layer for layer in plan.layers if layer.found == "sdpa"]
    # encoder: 2 self; decoder: 2 self + 2 cross
    assert [layer.path for layer in sites] == [
        "encoder.0.attn", "encoder.1.attn", "decoder.0.attn", "decoder.0.cross_attn", "decoder.1.attn",
        "decoder.1.cross_attn"]
    assert all(layer.status == WILL_ROUTE for layer in sites) and plan.num_fused == 6
    assert plan.coverage_error(min_replaced=6, require_all=True) is None
    assert "6 found" in plan.summary() and "6 to route" in plan.summary()
    assert not any(sdpa.is_routed(m) for m in model.modules())  # inspect changes nothing

    report = replace_attention(model)
    assert [layer.status for layer in report.layers] == [ROUTED] * 6
    assert report.to_dict()["num_by_found"] == {"sdpa": 6}
    again = replace_attention(model)
    assert [layer.status for layer in again.layers] == [ALREADY_FUSED] * 6


def test_mixed_model_reports_module_sdpa_and_unrecognized_sites():
    class HandAttention(nn.Module):  # named like attention, computes it by hand
        def forward(self, x):
            return torch.softmax(x @ x.transpose(-1, -2), -1) @ x

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
            self.gqa = M.GQAAttention(16, 4, 2)
            self.my_attention = HandAttention()

    report = replace_attention(Mixed())
    rows = {layer.path: (layer.found, layer.status) for layer in report.layers}
    assert rows == {"mha": ("module", "replaced"), "gqa": ("sdpa", ROUTED), "my_attention": ("", SKIPPED)}
    assert "found" in [c.header for c in report.table().columns]
    assert "2 attention layer(s) fused" not in (report.coverage_error(require_all=True) or "")
    assert report.coverage_error(require_all=True).startswith("1 attention layer(s) cannot be fused")
    assert report.coverage_error(min_replaced=2) is None and report.coverage_error(min_replaced=3) is not None


# -- whole models: eager, training, export -----------------------------------------------------

def test_gqa_decoder_forward_and_training_gradients():
    model = M.gqa_decoder()
    fused = routed(model)
    ids = model.example_inputs["input_ids"]
    assert_parity(fused(ids), model(ids), FP32_REL)
    model.train(), fused.train()
    model(ids).logsumexp(-1).sum().backward()
    fused(ids).logsumexp(-1).sum().backward()
    fused_params = dict(fused.named_parameters())
    grads = [p.grad for p in model.parameters()]
    for name, p in model.named_parameters():
        assert_parity(fused_params[name].grad, p.grad, 1e-5, f"grad {name}", scale=grads)  # the parameters' scale
    calls = [sdpa.call_counter(m) for m in fused.modules() if sdpa.is_routed(m)]
    assert calls == [{"fused": 2}, {"fused": 2}]  # per layer: the eval forward and the training forward


def test_dropout_in_training_runs_stock_sdpa_and_is_reported():
    torch.manual_seed(0)
    model = M.NanoGPTAttention(32, 4, dropout=0.2)
    report = inspect_attention(model)
    assert report.layers[0].found == "sdpa" and "dropout" in report.layers[0].notes[0]
    fused = routed(model)
    x = torch.randn(2, 6, 32)
    fused.train()
    torch.manual_seed(1)
    out = fused(x)
    model.train()
    torch.manual_seed(1)
    assert torch.equal(out, model(x))
    fused.eval(), model.eval()
    assert_parity(fused(x), model(x), FP32_REL)
    assert sdpa.call_counter(fused) == {"stock: dropout_p=0.2 (attention dropout is not fused)": 1, "fused": 1}


def test_route_survives_deepcopy_and_torch_export():
    model = M.whisper_like()
    fused = routed(model)
    twice = copy.deepcopy(fused)
    inputs = model.example_inputs
    assert all(sdpa.is_routed(m) and m.forward.module is m for m in twice.modules() if sdpa.calls_sdpa(m))
    assert_parity(twice(**inputs), model(**inputs), FP32_REL)
    assert all(sdpa.call_counter(m) == {} for m in fused.modules() if sdpa.calls_sdpa(m))  # the copy counted its own
    exported = torch.export.export(twice, (), kwargs=inputs, strict=False)
    nodes = [n for n in exported.graph.nodes if n.op == "call_function" and "attn_export" in str(n.target)]
    assert len(nodes) == 6
    assert not any("scaled_dot_product" in str(n.target) for n in exported.graph.nodes)
    assert_parity(exported.module()(**inputs), model(**inputs), FP32_REL)


def test_swin_style_learned_bias_mask_training_stays_stock_inference_is_fused():
    """A mask built from a learned table requires grad in training: SDPA keeps it (its gradient
    reaches the table); without gradients the call is fused."""
    model = M.swin_sdpa()
    fused = routed(model)
    x = model.example_inputs["x"]
    fused.train(), model.train()
    fused(x).sum().backward()
    model(x).sum().backward()
    assert_parity(fused.bias_table.grad, model.bias_table.grad, 1e-6)
    assert list(sdpa.call_counter(fused)) == ["stock: attn_mask requires grad (the operator treats masks as constants)"]
    with torch.no_grad():
        assert_parity(fused(x), model(x), FP32_REL)
    assert sdpa.call_counter(fused)["fused"] == 1


def test_torch_compile_traces_the_fused_calls():
    model = M.gqa_decoder()
    fused = routed(model)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = model.example_inputs["input_ids"]
    with torch.no_grad():
        out = torch.compile(fused, backend=backend, fullgraph=True)(ids)
        assert_parity(out, model(ids), FP32_REL)
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("attn_export.attention" in t for t in targets) == 2
    assert not any("scaled_dot_product" in t for t in targets)
