"""fold_past_custom: the custom flavor of a cached export: the Concat that appends a layer's new
keys and values to its past (transformers' cache, exported as the model's own code) folded into
the FusedAttention node's cache form (has_past = 1: inputs ``past_key``/``past_value``, outputs
``present_key``/``present_value``; docs/onnx_node.md, "The cache form").

The pattern is the standard flavor's (``editing.find_past``, which standard_attention also folds):

    past [B, Hkv, P, D] --Concat(axis 2)--> present [B, Hkv, P+S, D]
        --Transpose(0, 2, 1, 3)--> --Reshape--> [B, P+S, Hkv*D] --> node

becomes ``FusedAttention(q, k_new, v_new, masks, past_key, past_value) -> (y, present_key,
present_value)`` with ``k_new`` the new keys [B, S, Hkv*D]: the graph keeps no pass over the cache
outside the node (the node writes the present and reads its keys head-major). The masks were
already built over the present's length P+S. Any causal alignment folds: the node keeps its own.

All or none: a model's custom nodes are folded only when every one of them has the pattern, so
that the model has nodes of one form and its generic body (the first function named
FusedAttention, attach_functions) fits every node.
"""
from __future__ import annotations

from typing import List

import onnx
from onnx import helper

from attn_export import spec as _spec
from attn_export.onnx.editing import (
    GraphIndex, NodeBuilder, PastFold, attention_nodes, drop_concats, find_past, remove_unused, replace_nodes,
    sequence_first,
)
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class FoldPastCustom(GraphPass):
    """A cached export's Concat(past, new) into the custom nodes' cache form (also the nodes the
    standard flavor kept custom); a model without such a pattern is left as it is."""

    name = "fold_past_custom"

    def applies(self, context: PassContext) -> bool:
        return super().applies(context) and context.attention_nodes > 0

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        return PassOutcome(fold_past(model))


def fold_past(model: onnx.ModelProto) -> int:
    """Rewrites, in place, every FusedAttention node of the spec's domain into the cache form
    when each of them reads its key and value through Concat(past graph input, new); returns how
    many were folded (0: none had the pattern, or not all did)."""
    s = _spec.load()
    targets = [n for n in attention_nodes(model) if n.domain == s.domain and len(n.input) == len(s.input_names)]
    index = GraphIndex(model)
    folds = {id(n): find_past(index, n, top_left_causal=False) for n in targets}
    if not targets or any(f is None for f in folds.values()):
        return 0
    nodes: List[onnx.NodeProto] = []
    for position, node in enumerate(model.graph.node):
        fold = folds.get(id(node))
        nodes.extend(_cache_form(node, position, fold) if fold else [node])
    replace_nodes(model, drop_concats(nodes, list(folds.values())))
    remove_unused(model)  # the Transpose/Reshape that read the presents
    return len(targets)


def _cache_form(node: onnx.NodeProto, position: int, fold: PastFold) -> List[onnx.NodeProto]:
    """The new keys/values token-major, then the node with the cache inputs and outputs."""
    s = _spec.load()
    b = NodeBuilder(f"{node.name or s.op_type}_{position}/past")
    key, value = sequence_first(b, fold.new_key, "k"), sequence_first(b, fold.new_value, "v")
    inputs = [node.input[0], key, value, *node.input[3:], fold.past_key, fold.past_value]
    outputs = [node.output[0], fold.present_key, fold.present_value]
    folded = helper.make_node(node.op_type, inputs, outputs, name=node.name, domain=node.domain)
    folded.attribute.extend(a for a in node.attribute if a.name != s.attr_has_past)
    folded.attribute.append(helper.make_attribute(s.attr_has_past, 1))
    return b.nodes + [folded]
