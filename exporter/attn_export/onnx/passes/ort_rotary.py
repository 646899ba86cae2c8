"""ort_rotary: the rotary embedding's chains (Slice/Neg/Concat/Mul/Add per query and key) as
ONNX Runtime's ``com.microsoft.RotaryEmbedding`` on the projections, reading the graph's
position ids and cos/sin caches computed from the model's ``inv_freq``
(attn_export.onnx.ort.rotary)."""
from __future__ import annotations

from attn_export.onnx.ort.rotary import fuse_rotary
from attn_export.onnx.passes.base import CountingPass


class OrtRotary(CountingPass):
    name = "ort_rotary"
    flavors = ("ort",)
    rewrite = staticmethod(fuse_rotary)
    note = 'rotary embeddings as RotaryEmbedding: {}'
