"""Hugging Face transformers models: their attention routed through ``attn_export::attention``
by transformers' own extension point, not by patching classes.

    >>> import attn_export.surgery.transformers
    >>> attn_export.surgery.transformers.register()                       # once; replace_attention does it too
    >>> model = AutoModel.from_pretrained(path, attn_implementation="attn_export")
    >>> # or, on a model already built:
    >>> report = attn_export.replace_attention(model)   # sets attn_implementation="attn_export"

How it works (docs/huggingface.md):

* :func:`attention_forward` is registered in transformers' ``AttentionInterface`` under the name
  :data:`IMPLEMENTATION` (``"attn_export"``). Every attention layer written against that
  interface (``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``: BERT,
  GPT-2, ViT and most current architectures) calls it with ``query``/``key``/``value``
  ``[B, H, L, D]``, the mask the model built, ``scaling`` and ``dropout``, and gets back the
  attention output ``[B, L, H, D]`` (and no weights), as from the ``sdpa`` implementation.
* :func:`attention_mask` is registered under the same name in ``AttentionMaskInterface``, so
  the models build the mask that :func:`attention_forward` expects, compact where it can be: a
  plain padding mask of a bidirectional model stays one row per key, ``[B, 1, 1, Lk]``; a plain
  causal mask (no cache or a ``DynamicCache``) is the 2-D padding mask ``[B, Lk]`` (or ``None``),
  which becomes ``is_causal`` aligned bottom-right; either padding is the operator's
  ``key_padding_mask`` (in ONNX the node's rank-2 mask input) instead of a ``[B, 1, L, L]``
  tensor. Other masks (sliding windows, packed sequences, overlays, static caches) are the
  boolean ``sdpa`` mask (``True`` = attend).
* :func:`route` sets ``attn_implementation`` on a model that is already built
  (``model.set_attn_implementation``) and checks, layer by layer, that each attention module now
  dispatches to it.

Supported transformers versions: :data:`MIN_VERSION` and later (the first release with both
interfaces); checked with 4.53.0, 4.57.6 and 5.24.0. Which architectures dispatch through the
interface depends on the version (BERT from 5.0; GPT-2 and ViT in all of them): layers that do
not are reported as skipped. See docs/huggingface.md.

Modules: ``compat`` (transformers versions), ``interface`` (the registered attention function),
``masks`` (the registered mask function and the mask conversions),
``routing`` (a built model -> the interface), ``models`` (export/validation helpers, loading),
``alibi`` (Bloom's and MPT's attention, which bypass the interface, for the ``alibi`` route).
"""
from attn_export.surgery.transformers.compat import (
    IMPLEMENTATION,
    INSTALL_HINT,
    MIN_VERSION,
    UnsupportedTransformersError,
    _version_tuple,
    contains_hf_model,
    is_hf_model,
)
from attn_export.surgery.transformers.interface import (
    attention_forward,
    attention_mask,
    register,
    to_operator_masks,
    unfused_calls,
    unfused_reason,
)
from attn_export.surgery.transformers.models import (
    TOKEN_INPUTS,
    default_axes,
    example_inputs,
    int_ranges,
    is_pretrained_dir,
    load,
    max_positions,
    prepare_for_export,
    valid_token_mask,
)
from attn_export.surgery.transformers.routing import classify, dispatches_through_interface, layer_geometry, module_config, route

__all__ = [
    "IMPLEMENTATION", "INSTALL_HINT", "MIN_VERSION", "UnsupportedTransformersError", "_version_tuple",
    "contains_hf_model", "is_hf_model", "attention_forward", "attention_mask", "register", "to_operator_masks",
    "unfused_calls", "unfused_reason",
    "TOKEN_INPUTS", "default_axes", "example_inputs", "int_ranges", "is_pretrained_dir", "load", "max_positions",
    "prepare_for_export", "valid_token_mask", "classify", "dispatches_through_interface", "layer_geometry",
    "module_config", "route",
]
