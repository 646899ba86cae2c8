"""The input checks of the C++ binding (csrc/ops/attention_binding.cpp,
csrc/ops/multi_head_attention.cpp) in Python, with the same words, for the fake kernels
(ops/fake.py): tests/ops/core/test_fake.py holds the two to each other. Each refusal is a
``torch._check`` so that it also holds on symbolic sizes.
"""
from __future__ import annotations

import math

import torch

from attn_export import spec as _spec

_OPS = _spec.load()  # the attribute ranges (csrc/attention_spec.h kAttributeRanges)

_SCALAR_TYPE_NAMES = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.bool: "Bool",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
}


def _name(dtype: torch.dtype) -> str:
    """The dtype as c10 prints it, so fake and C++ messages read the same."""
    return _SCALAR_TYPE_NAMES.get(dtype, str(dtype))


def sizes_text(t: torch.Tensor | None) -> str:
    return "[]" if t is None else str(list(t.shape))


def _is_mask_dtype(dtype: torch.dtype) -> bool:
    return dtype == torch.bool or dtype.is_floating_point


def check_attention_inputs(query, key, value, attn_mask, key_padding_mask) -> None:
    torch._check(
        query.dim() == 4 and key.dim() == 4 and value.dim() == 4,
        lambda: "attention: query, key and value must be 4-D [batch, heads, seq, head_dim]; got query "
        f"{sizes_text(query)}, key {sizes_text(key)}, value {sizes_text(value)}",
    )
    torch._check(
        query.dtype.is_floating_point and key.dtype == query.dtype and value.dtype == query.dtype,
        lambda: "attention: query, key and value must share one floating dtype; got "
        f"{_name(query.dtype)}, {_name(key.dtype)}, {_name(value.dtype)}",
    )
    torch._check(
        key.device == query.device and value.device == query.device,
        lambda: "attention: query, key and value must be on one device; got "
        f"{query.device}, {key.device}, {value.device}",
    )
    torch._check(
        key.size(0) == query.size(0) and value.size(0) == query.size(0),
        lambda: "attention: query, key and value must agree in batch; got query "
        f"{sizes_text(query)}, key {sizes_text(key)}, value {sizes_text(value)}",
    )
    torch._check(
        value.size(1) == key.size(1)
        and (key.size(1) == query.size(1) or (key.size(1) > 0 and query.size(1) % key.size(1) == 0)),
        lambda: "attention: key and value heads must divide the query heads; got query "
        f"{sizes_text(query)}, key {sizes_text(key)}, value {sizes_text(value)}; give key and value one head count "
        "Hkv with H % Hkv == 0 (grouped-query attention: query head h reads key/value head h / (H / Hkv))",
    )
    torch._check(
        key.size(2) == value.size(2),
        lambda: "attention: key and value must have the same sequence length; got key "
        f"{sizes_text(key)} and value {sizes_text(value)}",
    )
    torch._check(
        key.size(3) == query.size(3),
        lambda: "attention: query and key must have the same head_dim; got query "
        f"{sizes_text(query)} and key {sizes_text(key)}",
    )
    check_attention_masks(
        query.size(0), query.size(1), query.size(2), key.size(2), query.device, attn_mask, key_padding_mask
    )


def check_attention_masks(batch, heads, seqlen_q, seqlen_k, device, attn_mask, key_padding_mask) -> None:
    if attn_mask is not None:
        m = attn_mask
        _check_mask_kind(m, "attn_mask", device)
        target = (batch, heads, seqlen_q, seqlen_k)
        # nn.MultiheadAttention's [batch*heads, Lq, Lk], or PyTorch's broadcasting to
        # [batch, heads, Lq, Lk] (the masks F.scaled_dot_product_attention takes), as the C++ checks.
        flat = m.dim() == 3 and batch * heads != 1 and tuple(m.shape) == (batch * heads, seqlen_q, seqlen_k)
        broadcasts = m.dim() <= 4 and all(
            size == 1 or size == want for size, want in zip(reversed(m.shape), reversed(target)))
        torch._check(
            flat or broadcasts,
            lambda: "attention: attn_mask must be [batch*heads, Lq, Lk] or broadcastable to "
            f"[batch, heads, Lq, Lk] = [{batch}, {heads}, {seqlen_q}, {seqlen_k}]; got {sizes_text(m)}",
        )
    if key_padding_mask is not None:
        m = key_padding_mask
        _check_mask_kind(m, "key_padding_mask", device)
        torch._check(
            m.dim() == 2 and m.size(0) == batch and m.size(1) == seqlen_k,
            lambda: f"attention: key_padding_mask must be [batch, Lk] = [{batch}, {seqlen_k}]; got {sizes_text(m)}",
        )


def _check_mask_kind(mask, name: str, device) -> None:
    """A mask's dtype (bool or floating) and device (the query's)."""
    torch._check(
        _is_mask_dtype(mask.dtype),
        lambda: f"attention: {name} must be bool or floating; got {_name(mask.dtype)}",
    )
    torch._check(
        mask.device == device,
        lambda: f"attention: {name} must be on the query's device {device}; got {mask.device}",
    )


def check_multi_head_attention_inputs(
    query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
    attn_mask, key_padding_mask, batch_first, packed_qkv=False,
) -> None:
    torch._check(
        query.dim() in (2, 3) and key.dim() == query.dim() and value.dim() == query.dim(),
        lambda: "multi_head_attention: query, key and value must all be 3-D (batched) or all 2-D "
        f"(unbatched); got query {sizes_text(query)}, key {sizes_text(key)}, value {sizes_text(value)}",
    )
    torch._check(num_heads > 0, lambda: f"multi_head_attention: num_heads must be positive; got {num_heads}")
    embed_dim = query.size(-1)
    torch._check(
        embed_dim % num_heads == 0,
        lambda: f"multi_head_attention: embed_dim {embed_dim} is not divisible by num_heads {num_heads}",
    )
    torch._check(
        key.size(-1) == embed_dim and value.size(-1) == embed_dim,
        lambda: f"multi_head_attention: key and value must have the query's embed_dim {embed_dim} "
        f"(kdim/vdim are not supported); got key {sizes_text(key)}, value {sizes_text(value)}",
    )
    torch._check(
        list(key.shape[:-1]) == list(value.shape[:-1]),
        lambda: "multi_head_attention: key and value must have the same length and batch; got key "
        f"{sizes_text(key)}, value {sizes_text(value)}",
    )
    if query.dim() == 3:
        batch_dim = 0 if batch_first else 1
        torch._check(
            key.size(batch_dim) == query.size(batch_dim),
            lambda: "multi_head_attention: query and key must have the same batch size (batch_first="
            f"{int(batch_first)}); got query {sizes_text(query)}, key {sizes_text(key)}",
        )
    _check_projections(query, key, value, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias)
    _check_layer_masks(query, key, num_heads, attn_mask, key_padding_mask, batch_first)
    torch._check(
        not packed_qkv or (list(key.shape) == list(query.shape) and list(value.shape) == list(query.shape)),
        lambda: "multi_head_attention: packed_qkv needs key and value of the query's shape "
        f"{sizes_text(query)}; got key {sizes_text(key)}, value {sizes_text(value)}",
    )
    # The masks against the layer's geometry, as the C++ layer checks them next.
    unbatched = query.dim() == 2
    seq_dim = 0 if unbatched or not batch_first else 1
    check_attention_masks(
        1 if unbatched else query.size(0 if batch_first else 1), num_heads, query.size(seq_dim),
        key.size(seq_dim), query.device, attn_mask,
        key_padding_mask.unsqueeze(0) if key_padding_mask is not None and unbatched else key_padding_mask,
    )


def _check_projections(query, key, value, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias) -> None:
    embed_dim = query.size(-1)
    torch._check(
        in_proj_weight.dim() == 2
        and in_proj_weight.size(0) == 3 * embed_dim
        and in_proj_weight.size(1) == embed_dim,
        lambda: "multi_head_attention: in_proj_weight must be [3*embed_dim, embed_dim] = "
        f"[{3 * embed_dim}, {embed_dim}]; got {sizes_text(in_proj_weight)}",
    )
    torch._check(
        in_proj_bias is None or (in_proj_bias.dim() == 1 and in_proj_bias.size(0) == 3 * embed_dim),
        lambda: f"multi_head_attention: in_proj_bias must be [3*embed_dim] = [{3 * embed_dim}]; got "
        f"{sizes_text(in_proj_bias)}",
    )
    torch._check(
        out_proj_weight.dim() == 2
        and out_proj_weight.size(0) == embed_dim
        and out_proj_weight.size(1) == embed_dim,
        lambda: "multi_head_attention: out_proj_weight must be [embed_dim, embed_dim] = "
        f"[{embed_dim}, {embed_dim}]; got {sizes_text(out_proj_weight)}",
    )
    torch._check(
        out_proj_bias is None or (out_proj_bias.dim() == 1 and out_proj_bias.size(0) == embed_dim),
        lambda: f"multi_head_attention: out_proj_bias must be [embed_dim] = [{embed_dim}]; got "
        f"{sizes_text(out_proj_bias)}",
    )
    for w in (key, value, in_proj_weight, out_proj_weight):
        torch._check(
            w.dtype == query.dtype,
            lambda: "multi_head_attention: every input and weight must have the query's dtype "
            f"{_name(query.dtype)}; got {_name(w.dtype)}",
        )


def _check_layer_masks(query, key, num_heads, attn_mask, key_padding_mask, batch_first) -> None:
    if key_padding_mask is not None:
        m = key_padding_mask
        want_dim = 2 if query.dim() == 3 else 1
        key_len = key.size(1 if batch_first and query.dim() == 3 else 0)
        torch._check(
            m.dim() == want_dim and m.size(-1) == key_len,
            lambda: "multi_head_attention: key_padding_mask must be [batch, Lk] (or [Lk] for unbatched "
            f"input); got {sizes_text(m)} for key {sizes_text(key)}",
        )
    if attn_mask is not None:
        m, batched = attn_mask, query.dim() == 3
        seq_dim = 1 if batched and batch_first else 0
        batch = query.size(0 if batch_first else 1) if batched else 1
        torch._check(
            (m.dim() == 2 or (m.dim() == 3 and (m.size(0) == 1 or m.size(0) == batch * num_heads)))
            and m.size(-2) == query.size(seq_dim) and m.size(-1) == key.size(seq_dim),
            lambda: "multi_head_attention: attn_mask must be 2-D [Lq, Lk] or 3-D [batch*num_heads, Lq, Lk]; "
            f"got {sizes_text(m)} for query {sizes_text(query)} and key {sizes_text(key)}",
        )


def check_core_attributes(attributes: dict) -> None:
    """The C++ check_core_attributes: each argument with a range in the spec (kAttributeRanges;
    the trailing attributes softcap, causal_alignment, ...) must lie in it."""
    for refusal in _OPS.refusals(attributes):
        torch._check(False, lambda refusal=refusal: f"attention: {refusal}")
    window, is_causal = attributes.get("window", 0), attributes.get("is_causal", False)
    torch._check(
        window == 0 or is_causal,
        lambda: "attention: window > 0 needs is_causal=True (the window ends at the causal diagonal); "
        f"got window={window} with is_causal=False: pass is_causal=True, or window=0 and a boolean attn_mask",
    )


# The largest finite float32: the kernels read the slopes in float32 (C++: numeric_limits<float>::max()).
FLOAT32_MAX = 3.4028234663852886e38


def check_alibi_slopes(alibi_slopes, num_heads) -> None:
    """The C++ check_alibi_slopes: None or empty is off; else one finite float32 slope per query head."""
    if not alibi_slopes:
        return
    torch._check(
        len(alibi_slopes) == num_heads,
        lambda: f"attention: alibi_slopes must have one slope per query head (num_heads = {num_heads}); got "
        f"{len(alibi_slopes)} slopes: pass num_heads floats, or None for no ALiBi",
    )
    for h, slope in enumerate(alibi_slopes):
        torch._check(
            math.isfinite(slope) and abs(slope) <= FLOAT32_MAX,
            lambda: f"attention: alibi_slopes must be finite float32 numbers; got {slope:g} for head {h}: pass "
            "finite slopes (Bloom and MPT: 2^(-8 (h + 1) / num_heads)), or None for no ALiBi",
        )


def check_softcap(softcap) -> None:
    """The softcap argument's check alone (check_core_attributes for that one argument)."""
    check_core_attributes({"softcap": softcap})
