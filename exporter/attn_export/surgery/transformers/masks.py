"""The masks of the ``attn_export`` implementation: the mask function registered in transformers'
AttentionMaskInterface, and the conversions between its masks and the operator's.

Two masks are kept compact (one row per key, never ``[B, 1, Lq, Lk]``):

* a plain bidirectional padding mask: ``[B, 1, 1, Lk]`` booleans, the operator's
  ``key_padding_mask``;
* a plain causal mask whose queries are the last ``Lq`` of the ``Lk`` keys (no cache, or a
  ``DynamicCache``): the 2-D padding mask ``[B, Lk]`` (booleans, ``True`` = attend) or ``None``,
  which the attention function turns into ``is_causal`` aligned bottom-right plus the
  ``key_padding_mask`` (as transformers' FlashAttention-2 mask: the kernel applies causality);
* the same with a sliding window (transformers' ``sliding_window_causal_mask_function``: Mistral,
  Gemma 2's local layers, Qwen2 with ``use_sliding_window``), also over a sliding-window cache
  whose first key is not position 0: the same 2-D padding mask, and the attention function
  passes the layer's ``sliding_window`` to the operator's ``window``.

Everything else (chunked attention, packed sequences, ``or``/``and`` overlays, static caches
with a tensor offset) is transformers' ``sdpa`` mask, built by its own function.
"""
from __future__ import annotations

from typing import Optional

import torch

from attn_export.surgery.sdpa.translate import is_one as _is_one
from attn_export.surgery.sdpa.translate import known_equal as _same_size
from attn_export.surgery.transformers.compat import IMPLEMENTATION

_NOT_COMPACT = object()  # the arguments ask for a mask the compact forms cannot express


def to_operator_masks(attention_mask: Optional[torch.Tensor], batch, key_length):
    """transformers' mask -> (attn_mask, key_padding_mask) in the operator's convention.

    * boolean (``True`` = attend, the ``sdpa`` convention): inverted (the operator's ``True`` =
      masked out);
    * floating: additive, as given (``eager``-style masks with large negatives included);
    * ``[B, Lk]`` (the compact causal form of :func:`attention_mask`) and ``[B|1, 1, 1, Lk]``
      (one row per key): the ``key_padding_mask`` ``[B, Lk]``;
    * ``[B|1, H|1, Lq, Lk]``: the ``attn_mask`` (a longer last axis is cut to ``Lk``).
    """
    if attention_mask is None:
        return None, None
    mask = attention_mask
    if mask.dtype == torch.bool:
        mask = ~mask
    if mask.dim() == 2:
        return None, mask
    if mask.dim() != 4:
        raise ValueError(
            f"attn_implementation='{IMPLEMENTATION}': expected a 2-D padding mask [B, Lk] or a 4-D attention "
            f"mask [B, 1, Lq, Lk], got shape {list(mask.shape)}"
        )
    if not _same_size(mask.shape[-1], key_length):
        # Older transformers build causal masks longer than the keys and slice them in the
        # attention function (as their sdpa function does).
        mask = mask[..., :key_length]
    if _is_one(mask.shape[1]) and _is_one(mask.shape[2]):
        return None, mask[:, 0, 0, :].expand(batch, key_length)
    return mask, None


def causal_bool(q_length, k_length, device, window=None) -> torch.Tensor:
    """[1, 1, Lq, Lk] booleans, ``True`` = attend: causal aligned bottom-right (the queries are the
    last ``Lq`` positions: query i sees keys j <= i + Lk - Lq; top-left when Lq == Lk), and
    within ``window`` keys of the query when a sliding window is given (transformers'
    ``sliding_window_overlay``: j > position - window). No length is compared (no guard on a
    symbolic length under torch.export)."""
    i = (torch.arange(q_length, device=device) + (k_length - q_length))[:, None]
    j = torch.arange(k_length, device=device)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    return allowed[None, None]


def materialized(attention_mask: Optional[torch.Tensor], causal: bool, q_length, k_length, device,
                 window=None) -> Optional[torch.Tensor]:
    """The mask as transformers' own attention functions take it ([B|1, 1, Lq, Lk] booleans or
    additive floats): a compact 2-D mask is crossed with the causal pattern it stands for, a
    causal call without a mask gets the pattern; 4-D masks are returned as they are."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return causal_bool(q_length, k_length, device, window) & attention_mask[:, None, None, :].bool()
    if attention_mask is None and causal:
        return causal_bool(q_length, k_length, device, window)
    return attention_mask


def attention_mask(*args, **kwargs):
    """The mask function registered as ``"attn_export"`` in ``AttentionMaskInterface``.

    A plain bidirectional padding mask (no offsets, no local window, no overlay) comes back as
    ``[B, 1, 1, Lk]`` booleans (``True`` = attend), a plain causal mask as the 2-D padding mask
    ``[B, Lk]`` (see the module's docstring); ``None`` for either without an ``attention_mask``.
    Everything else is the ``sdpa`` mask, built by transformers' own function with every
    argument passed on unchanged."""
    from transformers import masking_utils

    if not args and "kv_length" in kwargs:
        mask_function = kwargs.get("mask_function")
        compact = _NOT_COMPACT
        if mask_function is getattr(masking_utils, "bidirectional_mask_function", None):  # transformers >= 5
            compact = _bidirectional_padding(kwargs)
        elif mask_function is masking_utils.causal_mask_function:
            compact = _causal_padding(kwargs)
        elif sliding_window_of(mask_function) is not None and sliding_window_of(mask_function) == kwargs.get(
                "local_size"):
            compact = _causal_padding(kwargs, windowed=True)
        if compact is not _NOT_COMPACT:
            return compact
    sdpa_mask = masking_utils.AttentionMaskInterface._global_mapping["sdpa"]
    return sdpa_mask(*args, **kwargs)


def _traced_equal(a, b) -> bool:
    """Two symbolic sizes equal in the sample being traced (read from their hints: no guard)."""
    hints = [x.node.hint if isinstance(x, torch.SymInt) else None for x in (a, b)]
    return None not in hints and hints[0] == hints[1]


def _plain(kwargs) -> bool:
    """No key offset (the keys start at position 0) and no local window."""
    kv_offset = kwargs.get("kv_offset", 0)
    return isinstance(kv_offset, int) and kv_offset == 0 and kwargs.get("local_size") is None


def sliding_window_of(mask_function) -> Optional[int]:
    """The window of exactly ``sliding_window_causal_mask_function(window)`` (transformers' and_masks
    of its sliding_window_overlay and causal_mask_function, read from the closures); None for any
    other mask function (an overlay, a packed-sequence remap, ...)."""
    from transformers import masking_utils

    parts = _closure_values(mask_function, "and_masks")
    if parts is None or len(parts) != 1 or not isinstance(parts[0], tuple) or len(parts[0]) != 2:
        return None
    overlay, causal = parts[0]
    window = _closure_values(overlay, "sliding_window_overlay")
    if causal is not masking_utils.causal_mask_function or window is None or len(window) != 1:
        return None
    return window[0] if isinstance(window[0], int) and not isinstance(window[0], bool) and window[0] > 0 else None


def _closure_values(function, factory: str):
    """The values a function made by ``factory`` (a function of masking_utils) closes over, or None."""
    if not callable(function) or not getattr(function, "__qualname__", "").startswith(f"{factory}.<locals>."):
        return None
    return tuple(cell.cell_contents for cell in function.__closure__ or ())


def _bidirectional_padding(kwargs):
    q_offset = kwargs.get("q_offset", 0)
    if not (_plain(kwargs) and isinstance(q_offset, int) and q_offset == 0):
        return _NOT_COMPACT
    padding = kwargs.get("attention_mask")
    if padding is None:
        return None
    if padding.dim() == 2 and padding.dtype == torch.bool and _same_size(padding.shape[-1], kwargs["kv_length"]):
        return padding[:, None, None, :]
    return _NOT_COMPACT


def _causal_padding(kwargs, windowed: bool = False):
    """The 2-D padding mask (or None) for a causal mask whose queries are the last of the keys:
    ``q_offset + q_length == kv_offset + kv_length`` (a ``DynamicCache``: the offset is the past
    length; without a cache 0 and ``kv_length == q_length``; a sliding-window cache: kv_offset
    the first key kept, an int). Decided from sizes known without a guard; a tensor offset
    (static caches) is never compact. ``windowed``: the mask has the sliding window of
    ``local_size``, which the attention function applies from the layer's ``sliding_window``."""
    q_offset, q_length, kv_length = kwargs.get("q_offset", 0), kwargs.get("q_length"), kwargs["kv_length"]
    kv_offset = kwargs.get("kv_offset", 0)
    plain = _plain(dict(kwargs, local_size=None)) if windowed else _plain(kwargs)
    if windowed and isinstance(kv_offset, int) and isinstance(q_offset, int) and kv_offset > 0:
        # A sliding-window cache: the keys kept are the last kv_length positions, as the queries'.
        plain = isinstance(q_length, int) and isinstance(kv_length, int) and q_offset + q_length == kv_offset + kv_length
        q_offset -= kv_offset
    if not plain or isinstance(q_offset, torch.Tensor) or q_length is None:
        return _NOT_COMPACT
    if not _same_size(q_offset + q_length, kv_length):
        if not (isinstance(q_offset, int) and q_offset == 0 and _traced_equal(q_length, kv_length)):
            return _NOT_COMPACT
        # No cache, under torch.export: kv_length is the padding mask's length, a symbol of its
        # own; the keys are the queries' tokens, so the two lengths are one (the sdpa mask would
        # tie them as well, by indexing). Mask longer than the tokens (a prefix, as PEFT's prefix
        # tuning makes) fails the check above and stays transformers' mask.
        torch._check(q_length == kv_length)
    padding = kwargs.get("attention_mask")
    if padding is None:
        return None
    if padding.dim() != 2 or padding.dtype != torch.bool:
        return _NOT_COMPACT
    length = padding.shape[-1]
    if isinstance(length, int) and isinstance(kv_length, int):
        if length < kv_length:
            return _NOT_COMPACT
        return padding[:, length - kv_length:]  # the last kv_length keys, as transformers' FlashAttention-2 mask
    # Symbolic sizes (torch.export): a DynamicCache's mask covers exactly past + new tokens; the
    # operator checks that the key-padding mask has one entry per key rather than slicing here,
    # which would guard on the two lengths.
    return padding
