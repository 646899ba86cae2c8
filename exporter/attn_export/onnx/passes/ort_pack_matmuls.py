"""ort_pack_matmuls: sibling projections that read the same input (Q/K/V, gate/up) packed into
one MatMul and a Split, as ONNX Runtime GenAI's builder packs them (attn_export.onnx.ort.packed_matmul)."""
from __future__ import annotations

from attn_export.onnx.ort.packed_matmul import pack_sibling_matmuls
from attn_export.onnx.passes.base import CountingPass


class OrtPackMatMuls(CountingPass):
    name = "ort_pack_matmuls"
    flavors = ("ort",)
    rewrite = staticmethod(pack_sibling_matmuls)
    note = 'projections that read the same input packed into one MatMul each: {} group(s)'
