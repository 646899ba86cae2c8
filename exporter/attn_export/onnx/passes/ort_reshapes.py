"""ort_reshapes: the Reshape chains left around the attention operators that give back their
source's shape ([B, S, heads * D] -> [B, S, H, D] -> [B, S, heads * D]) dropped, one node fewer
each for ONNX Runtime to run per step (attn_export.onnx.ort.reshapes)."""
from __future__ import annotations

from attn_export.onnx.ort.reshapes import drop_identity_reshapes
from attn_export.onnx.passes.base import CountingPass


class OrtReshapes(CountingPass):
    name = "ort_reshapes"
    flavors = ("ort",)
    rewrite = staticmethod(drop_identity_reshapes)
    note = "Reshape chains that give back their source's shape dropped: {}"
