"""Fake (meta) kernels: output shapes, dtypes and strides without computing anything, so that
torch.export, torch.compile and FakeTensor can trace the operators.

Each fake repeats the input checks of the C++ binding with the same words (ops/input_checks.py;
tests/ops/core/test_fake.py holds them to it).
A fake takes its operator's arguments as the schema in csrc/attention_spec.h orders them
(``_fake`` binds them, ops/signatures.py): it names the ones it reads and takes the others as
``**_``, so an attribute that does not change the outputs' shapes needs no edit here.
"""
from __future__ import annotations

import torch

from attn_export import spec as _spec
from attn_export.ops import signatures
from attn_export.ops.input_checks import (  # noqa: F401 - the checks: public here too
    check_alibi_slopes,
    check_attention_inputs,
    check_attention_masks,
    check_core_attributes,
    check_multi_head_attention_inputs,
    check_softcap,
    sizes_text,
)

_OPS = _spec.load()  # the operators' names (csrc/attention_spec.h)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_token_major(like: torch.Tensor, batch, heads, seqlen, dim, dtype=None) -> torch.Tensor:
    """[B, H, L, D] with [B, L, H, D] memory, as the C++ empty_token_major allocates."""
    return like.new_empty((batch, seqlen, heads, dim), dtype=dtype or like.dtype).transpose(1, 2)


def empty_grad_like(like: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The gradient of a [B, H, L, D] input `source` as the C++ empty_grad_like allocates it
    (like's dtype and device): contiguous where the input is, token-major otherwise."""
    if source.is_contiguous():
        return like.new_empty(source.shape)
    return empty_token_major(like, *source.shape)


# Each operator's fake kernel as written below (before binding), for tests/test_spec.py.
FAKE_KERNELS = {}


def _fake(op: str):
    """Registers the decorated function as `op`'s fake kernel, called with every argument by
    name (the schema's defaults filled in)."""
    def register(kernel):
        torch.library.register_fake(op)(signatures.with_signature(op, kernel))
        FAKE_KERNELS[op] = kernel
        return kernel
    return register


@_fake(_OPS.torch_op_attention)
def _attention_fake(query, key, value, attn_mask, key_padding_mask, **attributes):
    check_attention_inputs(query, key, value, attn_mask, key_padding_mask)
    check_core_attributes(attributes)
    check_alibi_slopes(attributes["alibi_slopes"], query.size(1))
    return empty_token_major(query, query.size(0), query.size(1), query.size(2), value.size(3))


@_fake(_OPS.torch_op_attention_forward)
def _attention_forward_fake(query, key, value, attn_mask, key_padding_mask, need_weights, **attributes):
    check_attention_inputs(query, key, value, attn_mask, key_padding_mask)
    check_core_attributes(attributes)
    check_alibi_slopes(attributes["alibi_slopes"], query.size(1))
    batch, heads, seqlen_q, seqlen_k = query.size(0), query.size(1), query.size(2), key.size(2)
    out = empty_token_major(query, batch, heads, seqlen_q, value.size(3))
    lse = query.new_empty((batch, heads, seqlen_q), dtype=accumulation_dtype(query.dtype))
    weights = query.new_empty((batch, heads, seqlen_q, seqlen_k) if need_weights else (0,))
    return out, lse, weights


@_fake(_OPS.torch_op_attention_backward)
def _attention_backward_fake(grad_output, query, key, value, logsumexp, attn_mask, key_padding_mask, **attributes):
    check_attention_inputs(query, key, value, attn_mask, key_padding_mask)
    check_core_attributes(attributes)
    check_alibi_slopes(attributes["alibi_slopes"], query.size(1))
    batch, heads = query.size(0), query.size(1)
    torch._check(
        list(grad_output.shape) == [batch, heads, query.size(2), value.size(3)],
        lambda: "attention backward: grad_output must be [batch, heads, Lq, Dv] = "
        f"[{batch}, {heads}, {query.size(2)}, {value.size(3)}]; got {sizes_text(grad_output)}",
    )
    torch._check(
        list(logsumexp.shape) == [batch, heads, query.size(2)],
        lambda: "attention backward: logsumexp must be [batch, heads, Lq] = "
        f"[{batch}, {heads}, {query.size(2)}]; got {sizes_text(logsumexp)}",
    )
    torch._check(
        grad_output.device == query.device and logsumexp.device == query.device,
        lambda: "attention backward: grad_output and logsumexp must be on the query's device "
        f"{query.device}; got {grad_output.device} and {logsumexp.device}",
    )
    return empty_grad_like(query, query), empty_grad_like(query, key), empty_grad_like(query, value)


def _layer_outputs(query, key, num_heads, need_weights, average_attn_weights, batch_first):
    output = query.new_empty(query.shape)
    if not need_weights:
        return output, query.new_empty((0,))
    unbatched = query.dim() == 2
    seq_dim = 0 if unbatched or not batch_first else 1
    seqlen_q, seqlen_k = query.size(seq_dim), key.size(seq_dim)
    heads_shape = () if average_attn_weights else (num_heads,)
    batch_shape = () if unbatched else (query.size(0 if batch_first else 1),)
    return output, query.new_empty((*batch_shape, *heads_shape, seqlen_q, seqlen_k))


@_fake(_OPS.torch_op_multi_head_attention)
def _multi_head_attention_fake(
    query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
    attn_mask, key_padding_mask, need_weights, average_attn_weights, batch_first, **_,
):
    check_multi_head_attention_inputs(
        query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
        attn_mask, key_padding_mask, batch_first,
    )
    return _layer_outputs(query, key, num_heads, need_weights, average_attn_weights, batch_first)


@_fake(_OPS.torch_op_multi_head_attention_forward)
def _multi_head_attention_forward_fake(
    query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
    attn_mask, key_padding_mask, need_weights, average_attn_weights, batch_first, packed_qkv, **_,
):
    check_multi_head_attention_inputs(
        query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
        attn_mask, key_padding_mask, batch_first, packed_qkv,
    )
    output, weights = _layer_outputs(query, key, num_heads, need_weights, average_attn_weights, batch_first)
    embed_dim = query.size(-1)
    tokens_q = query.numel() // embed_dim
    unbatched = query.dim() == 2
    batch = 1 if unbatched else query.size(0 if batch_first else 1)
    seqlen_q = query.size(0 if unbatched or not batch_first else 1)
    if packed_qkv:
        q_proj, kv_proj = query.new_empty((tokens_q, 3 * embed_dim)), query.new_empty((0,))
    else:
        q_proj = query.new_empty((tokens_q, embed_dim))
        kv_proj = query.new_empty((key.numel() // embed_dim, 2 * embed_dim))
    attn = query.new_empty((tokens_q, embed_dim))
    lse = query.new_empty((batch, num_heads, seqlen_q), dtype=accumulation_dtype(query.dtype))
    return output, weights, q_proj, kv_proj, attn, lse


@_fake(_OPS.torch_op_multi_head_attention_backward)
def _multi_head_attention_backward_fake(
    grad_output, query, key, value, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
    packed_qkv, shared_kv, output_mask, **_,
):
    # A gradient is an empty tensor where it is not asked for, or where it flows through
    # another argument that is the same tensor (packed: all to query; shared_kv: to key).
    present = [
        output_mask[0],
        output_mask[1] and not packed_qkv,
        output_mask[2] and not packed_qkv and not shared_kv,
        output_mask[3],
        output_mask[4] and in_proj_bias is not None,
        output_mask[5],
        output_mask[6] and out_proj_bias is not None,
    ]
    like = [query, key, value, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias]
    return tuple(
        (_empty_in_weight_layout(grad_output, t) if i in (3, 5) else grad_output.new_empty(t.shape))
        if keep else grad_output.new_empty((0,))
        for i, (keep, t) in enumerate(zip(present, like))
    )


def _empty_in_weight_layout(like, weight):
    """A weight gradient laid out like the weight: column-major weights (FusedMultiheadAttention
    keeps its projections so) get column-major gradients, as csrc/ops/multi_head_attention.cpp
    returns them."""
    if weight.dim() == 2 and weight.size(0) > 1 and weight.stride(0) == 1:
        return like.new_empty((weight.size(1), weight.size(0))).t()
    return like.new_empty(weight.shape)
