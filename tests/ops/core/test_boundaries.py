"""The operator at the edges of its input space, against independent references: every mask
shape F.scaled_dot_product_attention takes, zero-size inputs of any layout, and the attention
weights at key lengths around the kernels' tile widths (16 and 32 floats)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attn_export
from attn_export import FusedMultiheadAttention
from helpers import assert_parity, qkv, reference_attention

# Run again under every lower instruction set the CPU has (tests/ops/cpu/test_instruction_sets.py).
pytestmark = pytest.mark.kernels

B, H, LQ, LK, D = 2, 3, 5, 7, 8

# Every rank and every subset of size-1 dims that broadcasts to [B, H, Lq, Lk] (SDPA's own rule;
# it refuses 1-D masks, which the operator takes as a row).
SDPA_MASK_SHAPES = [
    (LK,), (1,), (LQ, LK), (1, LK), (LQ, 1), (H, LQ, LK), (1, LQ, LK), (1, 1, LK), (H, 1, LK),
    (B, H, LQ, LK), (B, 1, 1, LK), (1, 1, 1, LK), (B, H, LQ, 1), (1, H, 1, LK), (B, 1, LQ, LK), (1, 1, 1, 1),
]


def _mask(shape, kind):
    m = torch.rand(shape) < 0.4
    m[..., 0] = False  # key 0 visible, so that SDPA (NaN on a fully masked row) is a reference too
    return m if kind == "bool" else torch.zeros(shape).masked_fill(m, -math.inf) + torch.randn(shape) * 0.5


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", SDPA_MASK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_mask_shape_sdpa_takes(shape, kind):
    mask = _mask(shape, kind)
    q, k, v = qkv(B, H, LQ, LK, D, requires_grad=True)
    out = attn_export.attention(q, k, v, attn_mask=mask)
    exact, _ = reference_attention(q, k, v, attn_mask=mask)
    # SDPA's bool convention is the opposite (True = attend); it takes masks of 2 dims or more
    # (the 1-D ones, which broadcast as well, go to it as one row).
    theirs = (~mask if kind == "bool" else mask).reshape((1,) * (2 - mask.dim()) + mask.shape)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=theirs)
    assert_parity(out, exact, 2e-6, "output vs float64")
    assert_parity(out, sdpa, 2e-6, "output vs SDPA")
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(exact, (q, k, v), grad.double())
    for g, w, name in zip(got, want, "qkv"):
        assert_parity(g, w, 5e-6, f"grad {name}", scale=want, n=LK)


@pytest.mark.parametrize("shape", [(LQ + 1, LK), (LK + 1,), (B + 1, 1, LQ, LK), (1, H + 1, 1, 1), (1, 1, B, H, LQ, LK),
                                   (B * H + 1, LQ, LK)], ids=str)
def test_masks_sdpa_refuses_are_refused_with_the_shapes(shape):
    q, k, v = qkv(B, H, LQ, LK, D)
    with pytest.raises(RuntimeError, match=r"broadcastable to \[batch, heads, Lq, Lk\] = \[2, 3, 5, 7\]; got"):
        attn_export.attention(q, k, v, attn_mask=torch.zeros(shape, dtype=torch.bool))


def test_multihead_attentions_flat_mask_keeps_its_meaning():
    # [B*H, Lq, Lk] is nn.MultiheadAttention's per-(batch, head) mask, not a broadcast one.
    mask = torch.rand(B * H, LQ, LK) < 0.4
    mask[..., 0] = False
    q, k, v = qkv(B, H, LQ, LK, D)
    out = attn_export.attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask.view(B, H, LQ, LK))
    assert_parity(out, want, 2e-6, "output")


def test_broadcast_masks_under_torch_export():
    class Core(nn.Module):
        def forward(self, q, k, v, mask):
            return attn_export.attention(q, k, v, attn_mask=mask)

    q, k, v = qkv(B, H, LQ, LK, D)
    mask = _mask((B, 1, 1, LK), "bool")
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    ep = torch.export.export(Core(), (q, k, v, mask), dynamic_shapes=(
        {0: batch}, {0: batch, 2: seq}, {0: batch, 2: seq}, {0: batch, 3: seq}))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.attn_export.attention.default) == 1, ops
    q2, k2, v2 = qkv(3, H, LQ, 11, D)
    mask2 = _mask((3, 1, 1, 11), "bool")
    assert_parity(ep.module()(q2, k2, v2, mask2), reference_attention(q2, k2, v2, attn_mask=mask2)[0], 2e-6, "output")


# ------------------------------------------------------------------------------------------
# Zero-size inputs
# ------------------------------------------------------------------------------------------

def _contiguous(x):
    return x


def _strided(x):  # every other element of a twice-as-long last dim
    return torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)[..., ::2]


def _token_major(x):  # [B, L, H, D] memory, as the layer's heads are
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("layout", [_contiguous, _strided, _token_major], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("sizes", [(0, 2, 5, 6, 8), (2, 0, 5, 6, 8), (2, 2, 0, 6, 8), (2, 2, 5, 0, 8), (0, 0, 0, 0, 8)],
                         ids=lambda s: "B{}H{}Lq{}Lk{}D{}".format(*s))
def test_zero_size_inputs_forward_and_backward(sizes, layout):
    b, h, lq, lk, d = sizes
    q, k, v = qkv(b, h, lq, lk, d, requires_grad=True)
    out = attn_export.attention(layout(q), layout(k), layout(v))
    want = F.scaled_dot_product_attention(q, k, v)
    assert out.shape == want.shape
    want = torch.nan_to_num(want)  # SDPA: NaN where a query sees no key (Lk = 0); ours: zeros
    assert torch.equal(out, torch.zeros_like(out)) if want.numel() and lk == 0 else True
    assert_parity(out, want, 2e-6, "output", scale=1.0)
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for g, x, name in zip(grads, (q, k, v), "qkv"):
        assert g is not None and g.shape == x.shape and torch.isfinite(g).all(), name
        if lk == 0 or lq == 0:
            assert not g.any(), name


def test_zero_batch_layer_matches_stock():
    ref = nn.MultiheadAttention(8, 2, batch_first=True)
    fused = FusedMultiheadAttention.from_module(ref)
    x = torch.randn(0, 5, 8, requires_grad=True)
    out, w = fused(x, x, x)
    out_ref, w_ref = ref(x, x, x)
    assert out.shape == out_ref.shape and w.shape == w_ref.shape
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.shape == x.shape


# ------------------------------------------------------------------------------------------
# Attention weights around the tile widths
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("seqlen_k", [15, 16, 17, 31, 32, 33, 48, 64])
def test_weights_of_causal_cross_attention_around_tile_widths(seqlen_k, dtype):
    # Row 0 sees key 0 only; every weight past the visible keys must be exactly 0 (the float64
    # path once left the tile padding's -inf in the returned weights).
    ref = nn.MultiheadAttention(4, 1, batch_first=True, dtype=torch.float64)
    fused = FusedMultiheadAttention.from_module(copy.deepcopy(ref)).to(dtype)  # shares nothing with ref
    q, k = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, seqlen_k, 4, dtype=torch.float64)
    mask = torch.ones(3, seqlen_k, dtype=torch.bool).triu(1)
    _, w = fused(q.to(dtype), k.to(dtype), k.to(dtype), attn_mask=mask, is_causal=True)
    _, w_ref = ref(q, k, k, attn_mask=mask, is_causal=True)
    assert torch.isfinite(w).all()
    assert not w[..., 3:].any()
    assert_parity(w, w_ref, 1e-12 if dtype == torch.float64 else 2e-6, "weights")


@pytest.mark.parametrize("seqlen", [16, 48, 80])
def test_float64_self_attention_weights_one_head(seqlen):
    ref = nn.MultiheadAttention(4, 1, dtype=torch.float64)
    fused = FusedMultiheadAttention.from_module(ref)
    x = torch.randn(seqlen, 1, 4, dtype=torch.float64)
    mask = torch.ones(seqlen, seqlen, dtype=torch.bool).triu(1)
    _, w = fused(x, x, x, attn_mask=mask, is_causal=True)
    _, w_ref = ref(x, x, x, attn_mask=mask)
    assert_parity(w, w_ref, 1e-12, "weights")


# ------------------------------------------------------------------------------------------
# The same masks through the ONNX export (the node's mask input stays 4-D)
# ------------------------------------------------------------------------------------------

class _Core(nn.Module):
    def forward(self, q, k, v, mask):
        return attn_export.attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", [(B, 1, 1, LK), (LK,), (LQ, 1), (H, LQ, LK), (1, 1, LK), (B * H, LQ, LK)],
                         ids=lambda s: "x".join(map(str, s)))
def test_every_mask_rank_exports_and_runs_in_onnx_runtime(shape, kind, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from attn_export.onnx import export_onnx

    # Declared dynamic: the batch (where the mask has it) and the key length (the mask's last
    # dim where it is not 1).
    def mask_axes(s):
        axes = {len(s) - 1: "seq"} if s[-1] == LK else {}
        return {**axes, 0: "batch"} if len(s) == 4 and s[0] == B else axes

    flat = shape[0] == B * H  # its first dim is batch*heads: the batch stays static
    batch_axis = {} if flat else {0: "batch"}
    dynamic = {"q": batch_axis, "k": {**batch_axis, 2: "seq"}, "v": {**batch_axis, 2: "seq"}, "mask": mask_axes(shape)}
    q, k, v = qkv(B, H, LQ, LK, D)
    path = tmp_path / "core.onnx"
    export_onnx(_Core(), {"q": q, "k": k, "v": v, "mask": _mask(shape, kind)}, path, dynamic_axes=dynamic)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seqlen_k in [(B, LK), (B, 11)] if flat else [(B, LK), (4, 11)]:
        q, k, v = qkv(batch, H, LQ, seqlen_k, D)
        s = tuple(batch if (len(shape) == 4 and i == 0 and d == B) else (seqlen_k if d == LK and i == len(shape) - 1 else d)
                  for i, d in enumerate(shape))
        mask = _mask(s, kind)
        got = session.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "mask": mask.numpy()})[0]
        assert_parity(torch.from_numpy(got), reference_attention(q, k, v, attn_mask=mask)[0], 2e-6,
                      f"ONNX Runtime at batch {batch}, Lk {seqlen_k}")
