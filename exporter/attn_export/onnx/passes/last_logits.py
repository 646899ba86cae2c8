"""last_logits: ``--last-logits``, a cached decoder's logits of the last position only, the
language-model head's input sliced before it (attn_export.onnx.last_logits). Before the
quantizer (the head stays a MatMul to find) and before the ort flavor's one If (which copies
the rest of the graph into its branches)."""
from __future__ import annotations

import onnx

from attn_export.errors import InputError
from attn_export.onnx.last_logits import keep_last_position
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class LastLogits(GraphPass):
    name = "last_logits"

    def applies(self, context: PassContext) -> bool:
        return bool(context.last_logits)

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        left = keep_last_position(model)
        if left is not None and context.last_logits is not True:  # the default of --genai-config
            context.last_logits = False
            return PassOutcome(0, (f"last_logits: every position's logits kept ({left})",))
        if left is not None:
            raise InputError(f"--last-logits: {left}; export without it")
        context.last_logits = True
        return PassOutcome(1, ("last_logits: the language-model head computes the last position's logits only "
                               "([batch, 1, vocab]); the prompt's other positions get none",))
