"""The custom flavor's cache fold, importable from here as before: the pass
:mod:`attn_export.onnx.passes.fold_past_custom`."""
from attn_export.onnx.passes.fold_past_custom import _cache_form, fold_past  # noqa: F401
