"""The drop-in's input checks: where nn.MultiheadAttention raises on a forward call, the fused
layer raises the same exception, type and message."""
from __future__ import annotations

from typing import Optional

import torch


def stock_error(module, call: dict) -> Optional[Exception]:
    """The exception nn.MultiheadAttention raises on the same call (same parameters, training
    mode and grad mode, so its eval fast path's checks too), or None where stock accepts it.
    Asked only on the failure path: the drop-in's errors are stock's, type and message."""
    stock = module.to_module()
    try:
        stock(**call)
    except Exception as error:  # noqa: BLE001 (whatever stock raises is the answer)
        return error
    return None


def nested_forward(module, call: dict):
    """Nested tensors, which the fused operators do not take: stock's result where its inference
    fast path takes them (self-attention in eval without grad: nn.TransformerEncoder sends them
    in eval with a padding mask when its layers look fusable to it), else the AssertionError of
    check_inputs, which names the fix."""
    try:
        return module.to_module()(**call)
    except Exception:  # noqa: BLE001 (stock refuses them too: our message says what to do)
        pass
    check_inputs(module, **call)
    raise AssertionError("unreachable: check_inputs refuses nested tensors")


def forward_call(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal):
    """A forward call's arguments by name (for stock_error; built on failure paths only)."""
    return dict(query=query, key=key, value=value, key_padding_mask=key_padding_mask, need_weights=need_weights,
                attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal)


def check_inputs(module, query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                  is_causal) -> None:
    """Raises stock's exception where nn.MultiheadAttention asserts on these inputs (the
    forward's arguments). Nested tensors get this module's own AssertionError, which
    names the fix (stock's fast path takes some of them, this module none)."""
    try:
        _assert_inputs(module, query, key, value, key_padding_mask, attn_mask)
    except AssertionError as ours:
        if any(x.is_nested for x in (query, key, value)):
            raise
        call = forward_call(query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
                             is_causal)
        raise stock_error(module, call) or ours from None


def _assert_inputs(module, query, key, value, key_padding_mask, attn_mask) -> None:
    """Raises where nn.MultiheadAttention raises AssertionError, with the same type. Only the
    checks stock asserts: everything else is left to the operators' own checks."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.is_nested:
            raise AssertionError(
                f"FusedMultiheadAttention does not take nested tensors ({name} is one): pass a padded "
                f"tensor and a key_padding_mask instead, e.g. {name}.to_padded_tensor(0.0)"
            )
    if query.dim() not in (2, 3):
        raise AssertionError(f"query must be unbatched [L, E] or batched 3-D; got a {query.dim()}-D query")
    batched = query.dim() == 3
    if key.dim() != query.dim() or value.dim() != query.dim():
        raise AssertionError(
            f"query, key and value must all be {query.dim()}-D ({'batched' if batched else 'unbatched'}); "
            f"got query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
        )
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
            raise AssertionError(f"only bool and floating types of {name} are supported; got {mask.dtype}")
    if key_padding_mask is not None and key_padding_mask.dim() != (2 if batched else 1):
        raise AssertionError(
            f"key_padding_mask must be {'[batch, Lk]' if batched else '[Lk]'}; got {list(key_padding_mask.shape)}"
        )
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise AssertionError(
            f"attn_mask must be 2-D [Lq, Lk] or 3-D [batch*num_heads, Lq, Lk]; got {list(attn_mask.shape)}"
        )
    if query.size(-1) != module.embed_dim:
        raise AssertionError(f"was expecting embedding dimension of {module.embed_dim}, but got {query.size(-1)}")
    if not module._qkv_same_embed_dim:
        for name, x, width in (("key", key, module.kdim), ("value", value, module.vdim)):
            if x.size(-1) != width:
                raise AssertionError(f"{name} must have {name[0]}dim={width} features; got {x.size(-1)}")
    same_len = key.shape[:-1] == value.shape[:-1]
    if not same_len or (module._qkv_same_embed_dim and key.shape != value.shape):
        raise AssertionError(f"key shape {list(key.shape)} does not match value shape {list(value.shape)}")
    seq_dim = 1 if batched and module.batch_first else 0
    if key_padding_mask is not None:
        batch = (key.size(1 - seq_dim),) if batched else ()
        if tuple(key_padding_mask.shape) != (*batch, key.size(seq_dim)):
            raise AssertionError(
                f"expecting key_padding_mask shape of {[*batch, key.size(seq_dim)]}, "
                f"but got {list(key_padding_mask.shape)}"
            )
    if attn_mask is not None:
        # nn.MultiheadAttention's mask shapes exactly (plus [1, Lq, Lk]), not the core op's
        # broadcasting, which the configurations projected in PyTorch reach.
        rows = (key.size(1 - seq_dim) if batched else 1) * module.num_heads
        tail = tuple(attn_mask.shape[-2:]) == (query.size(seq_dim), key.size(seq_dim))
        if not tail or (attn_mask.dim() == 3 and attn_mask.size(0) not in (1, rows)):
            raise AssertionError(
                f"attn_mask must be [Lq, Lk] or [batch*num_heads, Lq, Lk] = [{rows}, {query.size(seq_dim)}, "
                f"{key.size(seq_dim)}]; got {list(attn_mask.shape)}"
            )
    if not batched and attn_mask is not None and attn_mask.dim() == 3:
        expected = [module.num_heads, query.size(0), key.size(0)]
        if list(attn_mask.shape) != expected:
            raise AssertionError(f"Expected `attn_mask` shape to be {expected} but got {list(attn_mask.shape)}")
