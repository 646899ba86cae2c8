"""inline_functions (``functions="inline"``): the FusedAttention nodes' bodies written into the
graph; no model-local function and no custom node is left."""
from __future__ import annotations

import onnx

from attn_export.onnx import node as onnx_node
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class InlineFunctions(GraphPass):
    name = "inline_functions"

    def applies(self, context: PassContext) -> bool:
        return super().applies(context) and context.functions == "inline" and context.attention_nodes > 0

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        before = len(model.functions)
        inline_functions(model)
        return PassOutcome(before - len(model.functions))


def inline_functions(model: onnx.ModelProto) -> None:
    """Writes the FusedAttention nodes' bodies into the graph (``onnx.inliner``) and drops the
    functions and the domains they leave unused: a function-free model of standard ops."""
    import onnx.inliner

    model.CopyFrom(onnx.inliner.inline_local_functions(model))
    used = {n.domain for n in model.graph.node} | {n.domain for f in model.functions for n in f.node}
    imports = [o for o in model.opset_import if not onnx_node.is_attention_domain(o.domain) or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(imports)
