"""ort_quantize: ``--quantize int4|int8``, the MatMul weights quantized by ONNX Runtime's own
quantizer into ``com.microsoft.MatMulNBits`` (attn_export.onnx.ort.quantize)."""
from __future__ import annotations

import onnx

from attn_export.onnx.ort.quantize import ACCURACY_LEVEL, BITS, BLOCK_SIZE, quantize_weights
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class OrtQuantize(GraphPass):
    name = "ort_quantize"
    flavors = ("ort",)

    def applies(self, context: PassContext) -> bool:
        return super().applies(context) and context.quantize is not None

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        rewritten = quantize_weights(model, context.quantize)
        left = sum(1 for n in model.graph.node if n.op_type in ("MatMul", "Gemm"))
        done = ", ".join(f"{count} {op}" for op, count in sorted(rewritten.items())) or "no MatMul"
        note = (f"{context.quantize}: {done} with a 2-D weight -> com.microsoft.MatMulNBits ({BITS[context.quantize]} "
                f"bits, block {BLOCK_SIZE}, symmetric, accuracy_level {ACCURACY_LEVEL}); {left} MatMul/Gemm without "
                "a constant 2-D weight and the embedding's Gather stay float")
        return PassOutcome(sum(rewritten.values()), (note,))
