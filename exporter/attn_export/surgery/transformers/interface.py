"""The attention function and the mask function registered in transformers' AttentionInterface
and AttentionMaskInterface under the name ``attn_export``."""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from attn_export.surgery.transformers.compat import IMPLEMENTATION, UNSERVED_KWARGS, _transformers
from attn_export.surgery.transformers.masks import attention_mask, materialized, to_operator_masks

__all__ = ["attention_forward", "attention_mask", "register", "to_operator_masks", "unfused_reason", "unfused_calls"]


def unfused_reason(module: nn.Module, kwargs, attention_mask=None) -> Optional[str]:
    """Why this call cannot run on the fused operator (None: it can). The same rules as
    :func:`attn_export.surgery.transformers.routing.classify`, which predicts them from the layer's forward."""
    for name, what in UNSERVED_KWARGS.items():
        if kwargs.get(name) is not None:
            return f"{what} ({name}=...): not computed by the fused operator; transformers' eager attention runs"
    bias = kwargs.get("position_bias")
    learned = [t for t in (bias, attention_mask) if isinstance(t, torch.Tensor) and t.requires_grad]
    if learned and torch.is_grad_enabled():
        return ("a position bias or mask that requires grad (training a learned bias): the operator takes no "
                "gradient for its additive mask; transformers' eager attention runs")
    return None


def unfused_calls(module: nn.Module) -> Dict[str, int]:
    """The calls of ``module`` that ran transformers' attention instead of the operator since
    it was built: reason -> count (empty when every call was fused). The unfused part of
    :func:`attn_export.surgery.fused_calls`."""
    return dict(module.__dict__.get(_UNFUSED_CALLS) or {})


_FUSED_CALLS, _UNFUSED_CALLS = "_attn_export_fused_calls", "_attn_export_unfused_calls"
COUNTS = (_FUSED_CALLS, _UNFUSED_CALLS)  # the instance attributes a layer's calls are counted in


def _count_unfused(module: nn.Module, reason: str) -> None:
    counts = module.__dict__.setdefault(_UNFUSED_CALLS, {})
    counts[reason] = counts.get(reason, 0) + 1


def _count_fused(module: nn.Module) -> None:
    if not torch.compiler.is_compiling():  # a count is no part of a compiled graph
        module.__dict__[_FUSED_CALLS] = module.__dict__.get(_FUSED_CALLS, 0) + 1


def _eager_attention(module: nn.Module):
    """The modeling file's own ``eager_attention_forward`` (the one implementation that computes
    every feature of the architecture: sinks, biases, soft-capping); None if it has none."""
    import sys

    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (``True`` = masked out, the operator's convention) as an additive float
    mask with -inf; floating masks unchanged (cast)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def _run_unfused(module, reason, query, key, value, attention_mask, dropout, scaling, causal, kwargs):
    """One call on transformers' eager attention, with the mask in its convention: additive,
    large negative (not -inf, as transformers builds it) where masked, causality explicit."""
    eager = _eager_attention(module)
    if eager is None:
        raise NotImplementedError(
            f"{type(module).__name__}: {reason}, but its modeling file has no eager_attention_forward to run; "
            f"load the model with attn_implementation='eager'")
    _count_unfused(module, reason)
    mask = materialized(attention_mask, causal, query.shape[2], key.shape[2], query.device,
                        kwargs.get("sliding_window"))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


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
    ``key``/``value`` ``[B, Hkv, Lk, D]`` (grouped-query heads, not repeated: the operator reads them
    in place), ``attention_mask`` as
    built by the model (boolean ``True`` = attend, or additive floating, or ``None``). A 2-D
    mask ``[B, Lk]`` is the compact causal form of :func:`attention_mask`: causal plus that
    padding. Without a mask causality comes from ``is_causal`` or ``module.is_causal``; a 4-D
    mask already holds the causal pattern. Causality is aligned bottom-right (the queries are the
    last ``Lq`` positions of the keys, as with a cache; the same as top-left when ``Lq == Lk``).
    Returns ``(output [B, Lq, H, D], None)``.

    Also served: ``position_bias`` (T5's relative position bias: added to the operator's
    additive mask), ``softcap`` (Gemma 2's logit soft-capping: the operator's ``softcap``),
    ``sliding_window`` (the operator's ``window`` on causal calls: the compact mask and no mask;
    a materialized mask holds it already).

    Calls the operator cannot compute run transformers' eager attention of the layer's modeling
    file and are counted in :func:`unfused_calls` (see :func:`unfused_reason`); ``dropout > 0``
    in training runs transformers' ``sdpa`` function (dropout is not fused).
    """
    causal = _causal_call(module, attention_mask, is_causal)
    reason = unfused_reason(module, kwargs, attention_mask)
    if reason is not None:
        return _run_unfused(module, reason, query, key, value, attention_mask, dropout, scaling, causal, kwargs)
    if dropout and dropout > 0.0 and module.training:
        return _run_sdpa_with_dropout(module, query, key, value, attention_mask, dropout, scaling, is_causal, causal,
                                      kwargs)
    return _run_operator(module, query, key, value, attention_mask, scaling, causal, kwargs)


def _causal_call(module: nn.Module, attention_mask: Optional[torch.Tensor], is_causal: Optional[bool]) -> bool:
    """Whether the call is causal by what it was given: without a mask, ``is_causal`` or the
    layer's ``is_causal``; the compact 2-D mask always; a 4-D mask holds its pattern itself."""
    if attention_mask is None:
        return bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # only a plain causal mask is built compact (masks.attention_mask)
    return attention_mask.dim() == 2


def _run_sdpa_with_dropout(module, query, key, value, attention_mask, dropout, scaling, is_causal, causal, kwargs):
    """Training with dropout: transformers' ``sdpa`` function on the materialized mask (the
    operator fuses no dropout)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = materialized(attention_mask, causal and attention_mask is not None, query.shape[2], key.shape[2],
                        query.device, kwargs.get("sliding_window"))
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def _run_operator(module, query, key, value, attention_mask, scaling, causal: bool, kwargs):
    """The call through the operator: its masks, softcap, bottom-right causality and window;
    ``(output [B, Lq, H, D], None)``."""
    from attn_export.ops.functional import CausalAlignment, attention

    # Grouped-query heads go in as they are: the operator reads key/value head h // (H / Hkv).
    attn_mask, key_padding_mask, causal, window = _operator_masks(query, key.shape[2], attention_mask, causal,
                                                                  kwargs)
    softcap = kwargs.get("softcap")
    extra = {"softcap": float(softcap)} if softcap else {}
    if causal:  # bottom-right: with a cache the queries are the last positions (one query sees every key)
        extra["causal_alignment"] = CausalAlignment.BOTTOM_RIGHT
        if window:
            extra["window"] = window
    out = attention(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                    is_causal=causal, scale=scaling, **extra)
    _count_fused(module)
    # [B, H, Lq, D] laid out [B, Lq, H, D]: the transpose is free.
    return out.transpose(1, 2), None


def _operator_masks(query: torch.Tensor, k_length, attention_mask, causal: bool, kwargs: dict):
    """(attn_mask, key_padding_mask, is_causal, window) for the operator from what the layer was
    given: transformers' mask, a sliding window and T5's position bias. A causal call (the compact
    2-D mask, or none) of a sliding-window layer gets the layer's window as the operator's
    ``window`` (0: none); a materialized 4-D mask already holds the window."""
    window = kwargs.get("sliding_window")
    window = window if causal and isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0
    attn_mask, key_padding_mask = to_operator_masks(attention_mask, query.shape[0], k_length)
    bias = kwargs.get("position_bias")
    if bias is not None:
        attn_mask = bias if attn_mask is None else _additive(attn_mask, query.dtype) + bias
    if attn_mask is not None and attn_mask.dtype.is_floating_point and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    return attn_mask, key_padding_mask, causal, window


def register() -> None:
    """Registers :func:`attention_forward` and :func:`attention_mask` under ``"attn_export"``
    (idempotent). Raises :class:`UnsupportedTransformersError` when transformers is missing or
    older than :data:`MIN_VERSION`."""
    transformers = _transformers()
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)
