"""Where the exported graph's helpers used to live; each now has a home of its own, and these
names stay importable from here:

* output names: :mod:`attn_export.onnx.outputs`;
* reading and editing the graph (attention nodes, value types and dims):
  :mod:`attn_export.onnx.editing`;
* the metadata: :mod:`attn_export.onnx.metadata`;
* the graph passes (axis labels, functions, shapes, ...): :mod:`attn_export.onnx.passes`.
"""
from attn_export.onnx.editing import attention_nodes, count_attention_nodes, value_dims, value_types  # noqa: F401
from attn_export.onnx.metadata import META_PREFIX, read_metadata  # noqa: F401
from attn_export.onnx.outputs import _plain, flatten_outputs, output_names_for  # noqa: F401
from attn_export.onnx.passes.attach_functions import _generic_body_first, attach_function  # noqa: F401
from attn_export.onnx.passes.inline_functions import inline_functions  # noqa: F401
from attn_export.onnx.passes.label_axes import (  # noqa: F401
    _graph_dims,
    _normalize_numeric_dims,
    apply_axis_labels,
)
from attn_export.onnx.passes.label_axes import rename_symbols as _rename_symbols  # noqa: F401
from attn_export.onnx.passes.project_before_transpose import project_before_transposing_inputs  # noqa: F401
from attn_export.onnx.passes.record_shapes import record_shapes  # noqa: F401
