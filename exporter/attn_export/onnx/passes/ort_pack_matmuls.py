"""ort_pack_matmuls: sibling projections that read the same input (Q/K/V, gate/up) packed into
one MatMul and a Split, as ONNX Runtime GenAI's builder packs them; a model's own packed
projection's Slices as that Split, biases added before it (attn_export.onnx.ort.packed_matmul, packed_split)."""
from __future__ import annotations

from attn_export.onnx.ort.packed_matmul import pack_projections
from attn_export.onnx.passes.base import CountingPass


class OrtPackMatMuls(CountingPass):
    name = "ort_pack_matmuls"
    flavors = ("ort",)
    rewrite = staticmethod(pack_projections)
    note = 'projections packed into one MatMul and a Split each (siblings packed, slices, biases): {} rewrite(s)'
