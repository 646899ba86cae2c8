"""The standard-``Attention`` flavor's names, importable from here as before: the rewrite is the
pass :mod:`attn_export.onnx.passes.standard_attention`, the graph-editing helpers are
:mod:`attn_export.onnx.editing`'s, and :func:`attention_flavor` is :mod:`attn_export.onnx.flavor`'s.
"""
from attn_export.onnx._moved import moved_names
from attn_export.onnx.editing import NodeBuilder, read_names, remove_unused  # noqa: F401
from attn_export.onnx.flavor import attention_flavor  # noqa: F401
from attn_export.onnx.passes.standard_attention import (  # noqa: F401
    MIN_OPSET,
    StandardRewrite,
    check_opset,
    to_standard_attention,
    why_not_standard,
)

__getattr__ = moved_names(__name__, {
    "attention_nodes": "attn_export.onnx.editing",
    "value_dims": "attn_export.onnx.editing",
    "value_types": "attn_export.onnx.editing",
    "is_attention_domain": "attn_export.onnx.node",
})
