"""record_shapes: ONNX shape inference's types and shapes kept in the file's ``value_info``."""
from __future__ import annotations

import onnx

from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class RecordShapes(GraphPass):
    name = "record_shapes"

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        before = len(model.graph.value_info)
        record_shapes(model)
        return PassOutcome(len(model.graph.value_info) - before)


def record_shapes(model: onnx.ModelProto) -> None:
    """Runs ONNX shape inference (through the model-local functions, with data propagation) and
    keeps what it finds in ``value_info``: every intermediate value gets its type and, where it
    can be known, its shape, so tools that read shapes from the file (Polygraphy, quantizers,
    TensorRT's parser) see them; torch's exporter leaves some values (the attention outputs, the
    out-projections) with a type alone. Not strict: a value inference cannot type stays as the
    exporter wrote it. Models over protobuf's 2 GB limit are left alone (saving refuses them)."""
    if model.ByteSize() > 2**31 - 1:
        return
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=False, data_prop=True)
    model.CopyFrom(inferred)
