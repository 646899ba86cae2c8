"""Shared test helpers: references independent of the code under test, and tolerances."""
from __future__ import annotations

import math

import torch
from torch import nn

from attn_export import FusedMultiheadAttention

EPS = {
    torch.float64: torch.finfo(torch.float64).eps,
    torch.float32: torch.finfo(torch.float32).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float16: torch.finfo(torch.float16).eps,
}


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| relative to the scale of the expected tensor (its largest magnitude)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual - expected).abs().max() / scale)


def assert_rel_close(actual, expected, rel: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = max_rel_err(actual, expected)
    assert err <= rel, f"{what}: max relative error {err:.3e} > {rel:.1e}"


def make_pair(embed_dim, num_heads, bias=True, batch_first=False, dtype=torch.float32):
    """A stock nn.MultiheadAttention and a fused layer sharing its parameters."""
    ref = nn.MultiheadAttention(embed_dim, num_heads, bias=bias, batch_first=batch_first, dtype=dtype)
    with torch.no_grad():  # non-zero biases so that bias gradients are exercised
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return ref, FusedMultiheadAttention.from_module(ref)


def reference_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None):
    """Float64 attention written from the definition, with nn.MultiheadAttention's mask
    conventions (bool True = masked out) and zeros for rows with no visible key."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    bias = torch.zeros(B, H, Lq, Lk, dtype=torch.float64)
    if attn_mask is not None:
        m = attn_mask
        if m.dim() == 3:
            m = m.reshape(-1, H, Lq, Lk) if m.shape[0] != 1 else m.unsqueeze(0)
        bias = bias + (torch.where(m, -math.inf, 0.0) if m.dtype == torch.bool else m.double())
    if key_padding_mask is not None:
        m = key_padding_mask[:, None, None, :]
        bias = bias + (torch.where(m, -math.inf, 0.0) if m.dtype == torch.bool else m.double())
    if is_causal:
        bias = bias.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).triu(1), -math.inf)
    s = s + bias
    visible = torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~visible, 0.0), dim=-1) * visible
    return p @ v, p
