"""ort_fusions: the rest of an ONNX Runtime-flavor graph fused for ONNX Runtime by onnxscript's
maintained rewriter (``optimize_for_ort``: RMSNorm/LayerNorm with the residual, GELU forms, ...;
attn_export.onnx.ort.fusions); the note counts what it fused."""
from __future__ import annotations

import onnx

from attn_export.onnx.ort.fusions import fuse_for_ort
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class OrtGraphFusions(GraphPass):
    name = "ort_fusions"
    flavors = ("ort",)

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        fused = fuse_for_ort(model)
        return PassOutcome(sum(fused.counts.values()), (fused.note(),))
