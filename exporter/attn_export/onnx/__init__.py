"""ONNX export with one portable custom node per fused attention layer.

    >>> result = attn_export.export_onnx(model, {"src": x}, "model.onnx")
    >>> result.num_attention_nodes, result.dynamic_axes

Path: ``torch.export`` keeps ``attn_export::multi_head_attention`` (and ``attention``) as single
nodes; torch's ONNX exporter translates each through ``custom_translation_table`` into ordinary
MatMul/Add projections on the initializers, ONE ``attn_export.FusedAttention`` node (the
attention core, docs/onnx_node.md) and the output projection. After export the node's
model-local function (standard ONNX ops) is attached, the symbolic dimensions are renamed to
the requested labels and ``onnx.checker.check_model(full_check=True)`` runs; the file is
written whole or not at all.

Modules: ``translation`` (the operators -> ONNX), ``pipeline`` (export_onnx: ``sample``,
``capture``, then the graph passes, ``saving``), ``dims`` (the torch.export Dims: which axes
share a symbol), ``editing`` (reading and editing the exported graph), ``passes`` (the graph
passes, one module each, in order: docs/architecture.md, "ONNX passes"), ``outputs`` (output
names), ``metadata``, ``flavor`` (which flavor a file uses).
"""
from attn_export.onnx.editing import count_attention_nodes
from attn_export.onnx.flavor import attention_flavor
from attn_export.onnx.metadata import META_PREFIX, read_metadata
from attn_export.onnx.outputs import flatten_outputs, output_names_for
from attn_export.onnx.passes.attach_functions import attach_function
from attn_export.onnx.passes.label_axes import apply_axis_labels
from attn_export.onnx.pipeline import (
    ATTENTION_FLAVORS,
    DEFAULT_OPSET,
    EXPORT_DTYPES,
    FUNCTION_MODES,
    ExportResult,
    export_onnx,
)
from attn_export.onnx.passes.standard_attention import to_standard_attention
from attn_export.onnx.translation import translate_attention, translate_multi_head_attention, translation_table

__all__ = [
    "export_onnx", "ExportResult", "ATTENTION_FLAVORS", "FUNCTION_MODES", "attention_flavor", "to_standard_attention", "DEFAULT_OPSET", "EXPORT_DTYPES", "META_PREFIX", "read_metadata",
    "count_attention_nodes", "attach_function", "apply_axis_labels", "output_names_for", "flatten_outputs",
    "translation_table", "translate_multi_head_attention", "translate_attention",
]
