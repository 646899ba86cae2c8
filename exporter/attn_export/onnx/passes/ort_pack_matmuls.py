"""ort_pack_matmuls: sibling projections that read the same input (Q/K/V, gate/up) packed into
one MatMul and a Split, as ONNX Runtime GenAI's builder packs them (attn_export.onnx.ort.packed_matmul)."""
from __future__ import annotations

import onnx

from attn_export.onnx.ort.packed_matmul import pack_sibling_matmuls
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class OrtPackMatMuls(GraphPass):
    name = "ort_pack_matmuls"
    flavors = ("ort",)

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        packed = pack_sibling_matmuls(model)
        notes = (f"projections that read the same input packed into one MatMul each: {packed} group(s)",) if packed else ()
        return PassOutcome(packed, notes)
