"""Typed Python entry points to the ``torch.ops.attn_export`` operators."""
from __future__ import annotations

import enum
import math
import numbers
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from attn_export.ops.input_checks import FLOAT32_MAX


class CausalAlignment(enum.IntEnum):
    """Where ``is_causal``'s diagonal sits when ``Lq != Lk`` (the operator's ``causal_alignment``)."""

    #: query ``i`` sees keys ``j <= i`` (``F.scaled_dot_product_attention``'s ``is_causal``).
    TOP_LEFT = 0
    #: query ``i`` sees keys ``j <= i + Lk - Lq``: the last query sees every key (a KV cache's new
    #: tokens; FlashAttention's convention, PyTorch's ``causal_lower_right``).
    BOTTOM_RIGHT = 1


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    causal_alignment: int = CausalAlignment.TOP_LEFT,
    window: int = 0,
    alibi_slopes: Union[Sequence[float], Tensor, None] = None,
) -> Tensor:
    """Scaled dot-product attention, ``softmax(cap(scale * q k^T) + masks) v``, as one operator.

    Args:
        query: ``Tensor[B, H, Lq, D]``.
        key: ``Tensor[B, Hkv, Lk, D]``, ``Hkv`` dividing ``H``: grouped-query attention (as
            SDPA's ``enable_gqa``), query head ``h`` reads key/value head ``h // (H // Hkv)``;
            ``Hkv = 1`` is multi-query attention. The gradients of key and value sum over each
            group's query heads.
        value: ``Tensor[B, Hkv, Lk, Dv]``.
        attn_mask: ``Tensor[B*H, Lq, Lk]`` (torch.nn.MultiheadAttention's layout, when the
            first dim is neither 1 nor H), or any shape that broadcasts to ``Tensor[B, H, Lq, Lk]``
            by PyTorch's rule (``[Lq, Lk]``, ``[B, 1, 1, Lk]``, ``[Lk]``, ...). Boolean: ``True`` marks a pair that may NOT attend
            (torch.nn.MultiheadAttention's convention, the opposite of
            ``F.scaled_dot_product_attention``). Floating: added to the scaled scores.
        key_padding_mask: ``Tensor[B, Lk]``; boolean ``True`` marks padding, floating is added.
        is_causal: query ``i`` attends keys ``j <= i`` (top-left aligned), or ``j <= i + Lk - Lq``
            with ``causal_alignment=CausalAlignment.BOTTOM_RIGHT``. Rows that see no key
            (bottom-right with ``Lq > Lk``: the first ``Lq - Lk``) yield zeros.
        scale: defaults to ``1 / sqrt(D)``.
        softcap: logit soft-capping (Gemma 2, Grok): the scaled score ``x`` becomes
            ``softcap * tanh(x / softcap)`` before the masks are added. ``None`` or 0: off.
            Must be finite and >= 0 (``ValueError`` otherwise).
        causal_alignment: a :class:`CausalAlignment` (or its int, 0 or 1); only read with
            ``is_causal``.
        window: sliding-window attention (Mistral, Gemma 2's local layers): with ``is_causal``,
            query ``i`` sees only the last ``window`` keys up to its causal diagonal,
            ``d - window < j <= d`` for the diagonal ``d = i`` (top-left) or ``i + Lk - Lq``
            (bottom-right): transformers' ``kv_idx > q_idx - sliding_window`` in absolute
            positions. 0 (the default): no window. ``window > 0`` without ``is_causal`` is
            refused (the window ends at the causal diagonal).
        alibi_slopes: ALiBi (Bloom, MPT), FlashAttention's ``alibi_slopes``: one slope ``m[h]`` per
            QUERY head (``H`` of them, also under grouped-query attention), a sequence of floats or
            a 1-D float tensor (read once, as float32; under ``torch.export`` pass a list). The
            score of query ``i`` and key ``j`` gets ``-m[h] * |i + Lk - Lq - j|`` after the scale and
            the soft-cap, with the masks: the distance from the bottom-right diagonal, whatever
            ``causal_alignment`` is. ``None`` or empty: off. Must be finite (``ValueError``, as for
            a length other than ``H``; ``TypeError`` for anything but numbers).

    Returns:
        ``Tensor[B, H, Lq, Dv]`` (memory laid out token-major, ``[B, Lq, H, Dv]``). A query row
        whose keys are all masked yields zeros, never NaN. Differentiable in query, key and
        value, each gradient contiguous where its input is and token-major otherwise (so that
        autograd keeps a leaf's gradient as it is); masks are treated as constants.
    """
    # The attributes left at the operator's defaults are not passed: graphs traced without them
    # look as they did before they existed.
    attributes = [0.0 if softcap is None else _checked_softcap(softcap), int(causal_alignment),
                  _checked_window(window), _checked_alibi_slopes(alibi_slopes, query.size(1))]
    # softcap 0.0, TOP_LEFT, window 0 and no slopes (None) are the defaults
    while attributes and attributes[-1] in (0, None):
        attributes.pop()
    return torch.ops.attn_export.attention.default(
        query, key, value, attn_mask, key_padding_mask, is_causal, scale, *attributes
    )


def _checked_softcap(softcap) -> float:
    """A finite softcap > 0 as a float; TypeError for a non-number, ValueError for a negative,
    infinite or NaN one."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number (None or 0 = off); got {type(softcap).__name__}")
    value = float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (None or 0 = off); got {softcap!r}")
    return value


def _checked_alibi_slopes(slopes, num_heads) -> Optional[List[float]]:
    """The slopes as a list of floats, None when off (None or empty); TypeError for anything but
    a sequence of real numbers or a 1-D floating tensor, ValueError for a length other than
    num_heads or a slope that is not finite in float32."""
    if slopes is None:
        return None
    if isinstance(slopes, Tensor):
        if slopes.dim() != 1 or not slopes.dtype.is_floating_point:
            raise TypeError("alibi_slopes must be a 1-D floating tensor or a sequence of floats (None = off); "
                            f"got a {slopes.dim()}-D {slopes.dtype} tensor")
        values = [float(x) for x in slopes.detach().to("cpu", torch.float64).tolist()]
    elif isinstance(slopes, (str, bytes)) or not isinstance(slopes, Sequence):
        raise TypeError(f"alibi_slopes must be a sequence of floats or a 1-D tensor (None = off); "
                        f"got {type(slopes).__name__}")
    else:
        for x in slopes:
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                raise TypeError(f"alibi_slopes must hold real numbers; got {type(x).__name__}")
        values = [float(x) for x in slopes]
    if not values:
        return None
    if len(values) != num_heads:
        raise ValueError(f"alibi_slopes must have one slope per query head (num_heads = {num_heads}); got "
                         f"{len(values)} slopes: pass num_heads floats, or None for no ALiBi")
    bad = [(h, v) for h, v in enumerate(values) if not math.isfinite(v) or abs(v) > FLOAT32_MAX]
    if bad:
        raise ValueError(f"alibi_slopes must be finite float32 numbers; got {bad[0][1]:g} for head {bad[0][0]}: pass "
                         "finite slopes (Bloom and MPT: 2^(-8 (h + 1) / num_heads)), or None for no ALiBi")
    return values


def _checked_window(window) -> int:
    """A window >= 0 as an int; TypeError for a non-integer, ValueError for a negative one."""
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int (0 = no window); got {type(window).__name__}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = no window); got {window!r}")
    return int(window)


def multi_head_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    num_heads: int,
    in_proj_weight: Tensor,
    in_proj_bias: Optional[Tensor],
    out_proj_weight: Tensor,
    out_proj_bias: Optional[Tensor],
    attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    need_weights: bool = True,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    batch_first: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The whole ``torch.nn.MultiheadAttention`` layer (no dropout) in one operator call.

    Shapes follow ``nn.MultiheadAttention``: ``query`` is ``Tensor[L, B, E]``
    (``Tensor[B, L, E]`` with ``batch_first``) or unbatched ``Tensor[L, E]``; key and value
    likewise with their own length. ``in_proj_weight`` is ``Tensor[3E, E]`` (q, k, v rows),
    ``out_proj_weight`` ``Tensor[E, E]``. Passing the same tensor as query, key and value
    selects one packed QKV projection.

    Returns ``(output, weights)``: ``weights`` is ``None`` unless ``need_weights``; then it
    is ``Tensor[B, Lq, Lk]`` averaged over heads, or ``Tensor[B, H, Lq, Lk]``.
    """
    output, weights = torch.ops.attn_export.multi_head_attention.default(
        query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
        attn_mask, key_padding_mask, need_weights, average_attn_weights, is_causal, batch_first,
    )
    return output, (weights if need_weights else None)
