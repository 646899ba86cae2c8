"""attach_functions: each FusedAttention node gets the model-local function of its body variant,
and the model the generic body first (docs/onnx_node.md, "The lean bodies")."""
from __future__ import annotations

import onnx

from attn_export import spec as _spec
from attn_export.onnx import node as onnx_node
from attn_export.onnx.editing import attention_nodes, value_types
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class AttachFunctions(GraphPass):
    name = "attach_functions"

    def applies(self, context: PassContext) -> bool:
        return super().applies(context) and context.attention_nodes > 0

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        return PassOutcome(attach_function(model, context.opset))


def attach_function(model: onnx.ModelProto, opset: int) -> int:
    """Gives each FusedAttention node of the spec's domain the lean body of its variant (static
    attributes and query type; onnx_node.BodyVariant): the node moves to the variant's domain,
    and the model carries one function per variant used and imports each variant's domain.
    Nodes already in a variant's domain, and functions the model already carries, are left as
    they are. Returns how many functions the model gained.

    The model's first function named FusedAttention is the generic body (of the nodes' form:
    the cache form's when they have it), in the spec's domain, called by no node: TensorRT's ONNX
    parser keys model-local functions by name alone (the first one wins), and when it runs a
    node's function rather than the plugin (parsers before 10.15 prefer the function; later ones
    fall back to it without the plugin) it must get a body that is right for every node,
    whatever its variant (docs/onnx_node.md)."""
    s = _spec.load()
    before = len(model.functions)
    types = value_types(model)
    have = {f.domain for f in model.functions if f.name == s.op_type}
    for node in attention_nodes(model):
        if node.domain != s.domain:
            continue
        variant = onnx_node.BodyVariant.of_node(node, types.get(node.input[0]))
        node.domain = variant.domain
        if variant.domain not in have:
            model.functions.append(onnx_node.lean_function_proto(opset, variant))
            have.add(variant.domain)
    _generic_body_first(model, opset)
    used = {n.domain for n in model.graph.node} | {f.domain for f in model.functions}
    imported = {o.domain for o in model.opset_import}
    model.opset_import.extend(onnx.helper.make_opsetid(d, s.domain_version) for d in sorted(used - imported)
                              if onnx_node.is_attention_domain(d))
    # Model-local functions are ONNX IR version 8.
    model.ir_version = max(model.ir_version, 8)
    return len(model.functions) - before


def _generic_body_first(model: onnx.ModelProto, opset: int) -> None:
    """The generic body as the model's first function named FusedAttention (attach_function)."""
    s = _spec.load()
    named = [f for f in model.functions if f.name == s.op_type]
    if named and named[0].domain == s.domain:
        return
    # The cache form's nodes (fold_past_custom folds all of a model's nodes or none) need the
    # generic body of their signature: 7 inputs, 3 outputs.
    past = any(len(n.input) > len(s.input_names) for n in attention_nodes(model))
    generic = [f for f in named if f.domain == s.domain] or [onnx_node.function_proto(opset, past=past)]
    rest = [f for f in model.functions if f not in generic]
    del model.functions[:]
    model.functions.extend(generic + rest)
