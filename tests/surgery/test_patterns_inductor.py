"""Every attention pattern PyTorch Inductor turns into SDPA (torch/_inductor/fx_passes/fuse_attention.py)
is turned into one attn_export::attention node by attn_export.surgery.patterns, with the same
result as the eager pattern. The patterns are Inductor's own functions, called as they are."""
import inspect

import pytest
import torch
from torch import nn

from attn_export.surgery.patterns import rewrite

from helpers import assert_parity

fuse_attention = pytest.importorskip("torch._inductor.fx_passes.fuse_attention",
                                     reason="this PyTorch has no Inductor attention patterns")

PATTERNS = sorted((int(name.rsplit("_", 1)[1]), fn) for name, fn in vars(fuse_attention).items()
                  if name.startswith("_sfdp_pattern_"))
# Inductor traces these in half precision (their casts say float16).
HALF = {7, 8, 9, 10}
B, H, L, D = 2, 4, 6, 8


class Pattern(nn.Module):
    def __init__(self, fn, extra):
        super().__init__()
        self.fn, self.extra = fn, extra

    def forward(self, *tensors):
        return self.fn(*tensors, **self.extra)


def _arguments(number, fn):
    """Inductor's argument names, given values of this test's shapes: [B, H, L, D] query, key and
    value ([B, L, H, D] where the pattern permutes them, [B*H, L, D] for bmm patterns), masks that
    leave every query some key, dropout_p = 0 (dropout is not fused; p = 0 is the identity)."""
    g = torch.Generator().manual_seed(number)
    names = list(inspect.signature(fn).parameters)
    source = inspect.getsource(fn)
    permuted = "permute(0, 2, 1, 3)" in source or "permute([0, 2, 1, 3])" in source
    flat = "torch.bmm(query" in source
    dtype = torch.float16 if number in HALF else torch.float32
    shape = (B * H, L, D) if flat else (B, L, H, D) if permuted else (B, H, L, D)
    tensors = {n: torch.randn(*shape, generator=g).to(dtype) for n in ("query", "key", "value")}
    extra = {}
    for name in names[3:]:
        if name in ("inv_scale", "inv_scale_factor"):
            extra[name] = float(D) ** 0.5
        elif name == "scale_factor":
            extra[name] = float(D) ** -0.5
        elif name == "dropout_p":
            extra[name] = 0.0
        elif name == "causal_mask":  # True = may attend
            tensors[name] = torch.ones(L, L, dtype=torch.bool).tril()
        elif name in ("attn_mask", "attention_mask"):
            if "attn_mask == 0" in source:  # DistilBERT: [B, Lk] of 1 = keep
                mask = torch.ones(B, L)
                mask[-1, L // 2:] = 0
                tensors[name] = mask
            else:
                tensors[name] = torch.randn(B, 1, L, L, generator=g).to(dtype)
        else:
            raise AssertionError(f"pattern {number}: unknown argument {name}")
    return tensors, extra


@pytest.mark.parametrize("number, fn", PATTERNS, ids=[f"sfdp_{n}" for n, _ in PATTERNS])
def test_inductor_pattern_is_fused(number, fn):
    tensors, extra = _arguments(number, fn)
    model = Pattern(fn, extra).eval()
    args = tuple(tensors.values())
    expected = model(*args)
    exported = torch.export.export(model, args, strict=False)
    sites = rewrite(exported)
    assert [s.rewritten for s in sites] == [True], [s.reason for s in sites]
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.attn_export.attention.default) == 1
    assert not {torch.ops.aten.softmax.int, torch.ops.aten._safe_softmax.default} & set(targets)
    got = exported.module()(*args)
    got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    rel = 2e-3 if number in HALF else 2e-6
    for g, e in zip(got, expected):
        assert_parity(g, e, rel, f"pattern {number}", n=L)


def test_training_dropout_is_left_alone_with_its_reason():
    """Inductor fuses dropout into SDPA; the operator has none, so training-mode dropout stays."""
    fn = fuse_attention._sfdp_pattern_4
    tensors, extra = _arguments(4, fn)
    exported = torch.export.export(Pattern(fn, dict(extra, dropout_p=0.1)), tuple(tensors.values()), strict=False)
    (site,) = rewrite(exported)
    assert not site.rewritten and "aten.dropout.default with p=0.1 in training mode" in site.reason
