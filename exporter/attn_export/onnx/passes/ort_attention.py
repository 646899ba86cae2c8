"""ort_attention: the ONNX Runtime flavor's attention: each FusedAttention node becomes ONNX
Runtime's own contrib operator where it computes the node (``GroupQueryAttention`` for causal
self-attention with or without its cache, ``MultiHeadAttention`` for the rest it expresses;
attn_export.onnx.ort.attention); a node neither expresses stays custom, with the reason."""
from __future__ import annotations

import onnx

from attn_export.onnx.ort.attention import lower_attention
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome
from attn_export.onnx.passes.standard_attention import StandardRewrite


class OrtAttention(GraphPass):
    name = "ort_attention"
    flavors = ("ort",)

    def applies(self, context: PassContext) -> bool:
        return super().applies(context) and context.attention_nodes > 0

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        lowered = lower_attention(model)
        # The layers left custom are reported as the standard flavor's are (ExportResult.kept_custom).
        context.standard = StandardRewrite(converted=0, kept=lowered.kept)
        notes = []
        if lowered.converted:
            notes.append("ONNX Runtime contrib operators: " +
                         ", ".join(f"{op} x{n}" for op, n in sorted(lowered.converted.items())))
        notes.extend(f"kept as the custom node: {line}" for line in lowered.kept)
        return PassOutcome(sum(lowered.converted.values()), tuple(notes))
