"""The attention function and the mask function registered in transformers' AttentionInterface
and AttentionMaskInterface under the name ``attn_export``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from attn_export.hf._compat import _UNSUPPORTED_KWARGS, IMPLEMENTATION, _transformers
from attn_export.sdpa import is_one as _is_one
from attn_export.sdpa import repeat_heads
from attn_export.sdpa import known_equal as _same_size


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else repeat_heads(x, groups)




def to_operator_masks(attention_mask: Optional[torch.Tensor], batch, key_length):
    """transformers' mask -> (attn_mask, key_padding_mask) in the operator's convention.

    * boolean (``True`` = attend, the ``sdpa`` convention): inverted (the operator's ``True`` =
      masked out);
    * floating: additive, as given (``eager``-style masks with large negatives included);
    * ``[B|1, 1, 1, Lk]`` (one row per key): the ``key_padding_mask`` ``[B, Lk]``;
    * ``[B|1, H|1, Lq, Lk]``: the ``attn_mask`` (a longer last axis is cut to ``Lk``).
    """
    if attention_mask is None:
        return None, None
    mask = attention_mask
    if mask.dtype == torch.bool:
        mask = ~mask
    if mask.dim() != 4:  # e.g. a flash-attention style [B, Lk] mask: not built for this implementation
        raise ValueError(
            f"attn_implementation='{IMPLEMENTATION}': expected a 4-D attention mask [B, 1, Lq, Lk], got shape "
            f"{list(mask.shape)}"
        )
    if not _same_size(mask.shape[-1], key_length):
        # Older transformers build causal masks longer than the keys and slice them in the
        # attention function (as their sdpa function does).
        mask = mask[..., :key_length]
    if _is_one(mask.shape[1]) and _is_one(mask.shape[2]):
        return None, mask[:, 0, 0, :].expand(batch, key_length)
    return mask, None


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """The function registered as ``attn_implementation="attn_export"``.

    Same contract as transformers' ``sdpa_attention_forward``: ``query`` ``[B, H, Lq, D]``,
    ``key``/``value`` ``[B, Hkv, Lk, D]`` (grouped-query heads repeated), ``attention_mask`` as
    built by the model (boolean ``True`` = attend, or additive floating, or ``None``), causality
    from ``is_causal`` or ``module.is_causal`` when there is no mask (a mask, when given, already
    holds the causal pattern). Returns ``(output [B, Lq, H, D], None)``.

    ``dropout > 0`` (training with attention dropout) runs transformers' ``sdpa`` function
    instead: dropout is not fused.
    """
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attn_implementation='{IMPLEMENTATION}' does not implement {what} ({name}=...) used by "
                f"{type(module).__name__}; load the model with attn_implementation='sdpa' or 'eager'"
            )
    if dropout and dropout > 0.0 and module.training:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    from attn_export.ops import attention

    groups = getattr(module, "num_key_value_groups", 1)
    if isinstance(groups, int) and groups > 1:
        key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    q_length = query.shape[2]
    attn_mask, key_padding_mask = to_operator_masks(attention_mask, query.shape[0], key.shape[2])
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # One query attends to every key (decoding with a cache), as in transformers' sdpa path.
        causal = bool(causal) and not _is_one(q_length)
    else:
        causal = False  # the mask holds the pattern
    if attn_mask is not None and attn_mask.dtype.is_floating_point and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    # Gemma 2's attn_logit_softcapping: the operator caps the scaled scores before the mask, as
    # transformers' eager attention does.
    out = attention(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                    is_causal=causal, scale=scaling, softcap=kwargs.get("softcap"))
    # [B, H, Lq, D] laid out [B, Lq, H, D]: the transpose is free.
    return out.transpose(1, 2), None


def attention_mask(*args, **kwargs):
    """The mask function registered as ``"attn_export"`` in ``AttentionMaskInterface``.

    A plain bidirectional padding mask (no offsets, no local window, no overlay) comes back as
    ``[B, 1, 1, Lk]`` booleans (``True`` = attend), which :func:`attention_forward` passes to the
    operator as its key-padding mask; ``None`` without an ``attention_mask``. Everything else
    (causal, sliding windows, packed sequences, caches) is the ``sdpa`` mask, built by
    transformers' own function with every argument passed on unchanged."""
    from transformers import masking_utils

    bidirectional = getattr(masking_utils, "bidirectional_mask_function", None)  # transformers >= 5
    padding = kwargs.get("attention_mask")
    if (
        bidirectional is not None
        and not args
        and kwargs.get("mask_function") is bidirectional
        and not kwargs.get("kv_offset", 0)
        and not kwargs.get("q_offset", 0)
        and kwargs.get("local_size") is None
        and "kv_length" in kwargs
    ):
        if padding is None:
            return None
        if padding.dim() == 2 and padding.dtype == torch.bool and _same_size(padding.shape[-1], kwargs["kv_length"]):
            return padding[:, None, None, :]
    sdpa_mask = masking_utils.AttentionMaskInterface._global_mapping["sdpa"]
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Registers :func:`attention_forward` and :func:`attention_mask` under ``"attn_export"``
    (idempotent). Raises :class:`UnsupportedTransformersError` when transformers is missing or
    older than :data:`MIN_VERSION`."""
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)
