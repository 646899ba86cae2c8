"""ort_rotary: the rotary embedding's chains (Slice/Neg/Concat/Mul/Add per query and key) as
ONNX Runtime's ``com.microsoft.RotaryEmbedding`` on the projections, reading the graph's
position ids and cos/sin caches computed from the model's ``inv_freq``
(attn_export.onnx.ort.rotary)."""
from __future__ import annotations

import onnx

from attn_export.onnx.ort.rotary import fuse_rotary
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class OrtRotary(GraphPass):
    name = "ort_rotary"
    flavors = ("ort",)

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        fused = fuse_rotary(model)
        notes = (f"rotary embeddings as RotaryEmbedding: {fused}",) if fused else ()
        return PassOutcome(fused, notes)
