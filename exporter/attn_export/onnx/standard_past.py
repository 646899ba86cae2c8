"""The standard flavor of a cached export: the Concat that appends a layer's new keys and values
to its past (transformers' cache, exported as the model's own code) folded into the opset-23
``Attention`` node, whose ``past_key``/``past_value`` inputs and ``present_key``/``present_value``
outputs are that Concat (docs/onnx_node.md, "The standard flavor").

The pattern, on the FusedAttention node's key (and likewise value) input:

    past [B, Hkv, P, D] (graph input) --Concat(axis 2)--> present [B, Hkv, P+S, D]
        --Transpose(0, 2, 1, 3)--> [B, P+S, Hkv, D] --Reshape--> [B, P+S, Hkv*D] --> node

becomes ``Attention(q, k_new, v_new, mask, past_key, past_value) -> (y, present_key,
present_value)`` where ``k_new`` is the new keys [B, S, Hkv*D]. The operator aligns causal
masking bottom-right with a past; the rewrite keeps a node with top-left causal masking as it
was (the Concat stays), and builds its masks over the present's length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import onnx
from onnx import helper

_TO_SEQUENCE_FIRST = [0, 2, 1, 3]


@dataclass(frozen=True)
class PastFold:
    """One layer's cache, as the rewritten node reads and writes it."""

    past_key: str
    past_value: str
    new_key: str  # [B, Hkv, S, D], the Concat's second input
    new_value: str
    present_key: str  # the Concat's output: the node's output now
    present_value: str
    concats: tuple  # the two Concat nodes, which the node replaces


class GraphIndex:
    """Who produces each value, and which values are graph inputs."""

    def __init__(self, model: onnx.ModelProto):
        self.producer: Dict[str, onnx.NodeProto] = {o: n for n in model.graph.node for o in n.output}
        self.graph_inputs = {v.name for v in model.graph.input}

    def _made_by(self, name: str, op_type: str) -> Optional[onnx.NodeProto]:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def past_concat(self, name: str) -> Optional[onnx.NodeProto]:
        """The Concat(past, new) behind a node's key or value input, or None."""
        reshape = self._made_by(name, "Reshape")
        transpose = self._made_by(reshape.input[0], "Transpose") if reshape is not None else None
        if transpose is None or _ints(transpose, "perm") != _TO_SEQUENCE_FIRST:
            return None
        concat = self._made_by(transpose.input[0], "Concat")
        if concat is None or len(concat.input) != 2 or _int(concat, "axis") not in (2, -2):
            return None
        return concat if concat.input[0] in self.graph_inputs else None


def find_past(index: GraphIndex, node: onnx.NodeProto, top_left_causal: bool) -> Optional[PastFold]:
    """The cache a FusedAttention node reads through Concat(past, new), or None (no such
    pattern, or top-left causal masking, which the operator would align bottom-right)."""
    if top_left_causal:
        return None
    key, value = index.past_concat(node.input[1]), index.past_concat(node.input[2])
    if key is None or value is None:
        return None
    return PastFold(key.input[0], value.input[0], key.input[1], value.input[1], key.output[0], value.output[0],
                    (key, value))


def sequence_first(b, new: str, what: str) -> str:
    """[B, Hkv, S, D] -> [B, S, Hkv*D], the layout of the node's key and value inputs."""
    transposed = b.op("Transpose", [new], f"{what}_new_t", perm=_TO_SEQUENCE_FIRST)
    return b.op("Reshape", [transposed, b.const(f"{what}_new_shape", [0, 0, -1])], f"{what}_new")


def drop_concats(nodes, folds) -> list:
    """``nodes`` without the Concats the folded nodes replace (their outputs are the nodes' now)."""
    gone = {id(c) for fold in folds for c in fold.concats}
    return [n for n in nodes if id(n) not in gone]


def _ints(node: onnx.NodeProto, name: str):
    return next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == name), None)


def _int(node: onnx.NodeProto, name: str):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)
