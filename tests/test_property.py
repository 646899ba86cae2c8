"""Property test: random configurations of FusedMultiheadAttention against the stock
nn.MultiheadAttention built from the same weights."""
import copy
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attn_export import FusedMultiheadAttention
from helpers import EPS, max_rel_err, make_pair


@st.composite
def configs(draw):
    heads = draw(st.integers(1, 4))
    return dict(
        heads=heads,
        embed=heads * draw(st.sampled_from([1, 2, 4, 8, 16])),
        batch=draw(st.integers(1, 4)),
        seqlen_q=draw(st.integers(1, 20)),
        seqlen_k=draw(st.integers(1, 20)),
        self_attention=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        bias=draw(st.booleans()),
        attn_mask=draw(st.sampled_from([None, "bool", "float", "bool_3d"])),
        padding=draw(st.sampled_from([None, "bool", "float"])),
        causal=draw(st.booleans()),
        need_weights=draw(st.booleans()),
        average=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.float64, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
    )


def _case(c):
    gen = torch.Generator().manual_seed(c["seed"])
    if c["self_attention"] or c["causal"]:
        c["seqlen_k"] = c["seqlen_q"]
    B, H, Lq, Lk, E = c["batch"], c["heads"], c["seqlen_q"], c["seqlen_k"], c["embed"]
    shape = (lambda n: (B, n, E)) if c["batch_first"] else (lambda n: (n, B, E))
    q = torch.randn(shape(Lq), generator=gen)
    k, v = (q, q) if c["self_attention"] else (torch.randn(shape(Lk), generator=gen), torch.randn(shape(Lk), generator=gen))
    masks = {}
    # Key 0 always stays visible: nn.MultiheadAttention returns NaN for fully masked rows.
    if c["attn_mask"] is not None:
        dims = (B * H, Lq, Lk) if c["attn_mask"] == "bool_3d" else (Lq, Lk)
        if c["attn_mask"] == "float":
            m = torch.randn(dims, generator=gen)
        else:
            m = torch.rand(dims, generator=gen) < 0.3
            m[..., 0] = False
        masks["attn_mask"] = m
    if c["causal"]:
        # is_causal is nn.MultiheadAttention's hint that attn_mask IS the causal mask (it may
        # drop the mask and trust the hint), so the mask must be exactly causal here.
        causal = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
        as_float = c["attn_mask"] == "float"
        masks["attn_mask"] = torch.zeros(Lq, Lk).masked_fill(causal, -math.inf) if as_float else causal
        masks["is_causal"] = True
    if c["padding"] is not None:
        p = torch.rand(B, Lk, generator=gen) < 0.3
        p[:, 0] = False
        masks["key_padding_mask"] = p if c["padding"] == "bool" else torch.zeros(B, Lk).masked_fill(p, -1e4)
    if "attn_mask" in masks and "key_padding_mask" in masks:
        # nn.MultiheadAttention deprecates mixing a bool and a float mask: keep one kind.
        am, kp = masks["attn_mask"], masks["key_padding_mask"]
        if am.dtype != kp.dtype:
            masks["key_padding_mask"] = kp if am.dtype != torch.bool else kp < 0
    return q, k, v, masks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_fused_matches_stock_module(c):
    q, k, v, masks = _case(c)
    dtype = c["dtype"]
    ref, _ = make_pair(c["embed"], c["heads"], bias=c["bias"], batch_first=c["batch_first"], dtype=torch.float64)
    fused = FusedMultiheadAttention(c["embed"], c["heads"], bias=c["bias"], batch_first=c["batch_first"], dtype=dtype)
    fused.load_state_dict(ref.state_dict())  # also exercises state_dict compatibility
    masks_low = {k: (m.to(dtype) if isinstance(m, torch.Tensor) and m.is_floating_point() else m) for k, m in masks.items()}
    masks64 = {k: (m.double() if isinstance(m, torch.Tensor) and m.is_floating_point() else m) for k, m in masks.items()}
    kw = dict(need_weights=c["need_weights"], average_attn_weights=c["average"])
    qd = q.to(dtype)
    kd, vd = (qd, qd) if c["self_attention"] else (k.to(dtype), v.to(dtype))
    out, w = fused(qd, kd, vd, **masks_low, **kw)
    out_ref, w_ref = ref(q.double(), k.double(), v.double(), **masks64, **kw)
    assert out.dtype == dtype and out.shape == out_ref.shape
    if c["need_weights"]:
        assert w.shape == w_ref.shape
    else:
        assert w is None
    if dtype in (torch.float32, torch.float64):
        rel = 2e-6 if dtype == torch.float32 else 1e-12
        assert max_rel_err(out, out_ref) <= rel
        assert not c["need_weights"] or max_rel_err(w, w_ref) <= rel
        return
    # Half precision: the stock module run in the same dtype shows how much error rounding
    # alone costs; the fused layer (float32 inside) may not be more than twice as far off.
    low = copy.deepcopy(ref).to(dtype)
    out_low, w_low = low(qd, kd, vd, **masks_low, **kw)
    slack = 2 * EPS[dtype]
    assert max_rel_err(out, out_ref) <= 2 * max_rel_err(out_low, out_ref) + slack
    if c["need_weights"]:
        assert max_rel_err(w, w_ref) <= 2 * max_rel_err(w_low, w_ref) + slack
