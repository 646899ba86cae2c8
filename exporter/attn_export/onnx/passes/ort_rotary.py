"""ort_rotary: the rotary embedding's chains (Slice/Neg/Concat/Mul/Add per query and key) as
ONNX Runtime's ``com.microsoft.RotaryEmbedding`` on the projections, reading the graph's
position ids and cos/sin caches from the model's ``inv_freq`` (initializers of the model's
position limit where it is known)
(attn_export.onnx.ort.rotary)."""
from __future__ import annotations

from attn_export.onnx.ort.rotary import fuse_rotary
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class OrtRotary(GraphPass):
    name = "ort_rotary"
    flavors = ("ort",)

    def run(self, model, context: PassContext) -> PassOutcome:
        changed = fuse_rotary(model, context.max_positions)
        return PassOutcome(changed, (f"rotary embeddings as RotaryEmbedding: {changed}",) if changed else ())
