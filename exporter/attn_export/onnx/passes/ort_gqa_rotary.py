"""ort_gqa_rotary: each layer's Split and RotaryEmbeddings over its packed QKV MatMul taken into
GroupQueryAttention (packed input, ``do_rotary``) on the branch an unpadded call runs
(attn_export.onnx.ort.gqa_rotary)."""
from __future__ import annotations

from attn_export.onnx.ort.gqa_rotary import rotary_into_attention
from attn_export.onnx.passes.base import CountingPass


class OrtGqaRotary(CountingPass):
    name = "ort_gqa_rotary"
    flavors = ("ort",)
    rewrite = staticmethod(rotary_into_attention)
    note = 'packed QKV and rotary embedding read by GroupQueryAttention itself (do_rotary): {} layers'
