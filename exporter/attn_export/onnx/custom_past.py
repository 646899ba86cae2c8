"""The custom flavor's cache fold, importable from here as before: the pass
:mod:`attn_export.onnx.passes.fold_past_custom`."""
from attn_export.onnx._moved import moved_names
from attn_export.onnx.passes.fold_past_custom import _cache_form, fold_past  # noqa: F401

__getattr__ = moved_names(__name__, {
    "NodeBuilder": "attn_export.onnx.editing",
    "attention_nodes": "attn_export.onnx.editing",
    "remove_unused": "attn_export.onnx.editing",
})
