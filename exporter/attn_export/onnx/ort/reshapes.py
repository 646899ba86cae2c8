"""Reshape chains that give back their source's own shape, dropped: after the attention reads
and writes [B, S, heads * D] (attention.py, rotary.py), what is left of the head split and
merge around it is ``Reshape(Reshape(x, [B, S, H, D]), [B, S, -1])``, the identity, twice per
layer (the value going in, the output coming out). ONNX Runtime runs each as a node of its own.

A chain is dropped when the recorded shapes (the axis labels, label_axes.py) of its source and
of its end are the same, every axis a label or a size; the source of an attention operator's
output, whose shape is not recorded, has its query's shape.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import onnx

from attn_export.onnx.editing import GraphIndex, remove_unused, value_dims
from attn_export.onnx.ort.nodes import MS_DOMAIN

_SAME_SHAPE_AS_QUERY = ("GroupQueryAttention", "MultiHeadAttention")


def drop_identity_reshapes(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each Reshape chain whose end has its source's shape; returns how many."""
    index, dims = GraphIndex(model), value_dims(model)
    renames: Dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.output[0] in index.graph_outputs:
            continue
        source = node.input[0]
        while index.made_by(source, "Reshape") is not None:
            source = index.made_by(source, "Reshape").input[0]
        end = dims.get(node.output[0])
        if _known(end) and end == _dims(index, dims, source):
            renames[node.output[0]] = source
    if not renames:
        return 0
    _rename_reads(model.graph, renames)
    remove_unused(model)
    return len(renames)


def _known(shape: Optional[List[object]]) -> bool:
    return bool(shape) and all(d is not None and d != "" and d != 0 for d in shape)


def _dims(index: GraphIndex, dims, name: str) -> Optional[List[object]]:
    """The value's recorded shape; for an attention operator's output (or an If that chooses
    between two), its query's."""
    if name in dims and _known(dims[name]):
        return dims[name]
    node = index.producer.get(name)
    if node is None or list(node.output).index(name) != 0:
        return None
    if node.op_type == "If":
        inner = [n for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for n in a.g.node]
        if inner and all(n.domain == MS_DOMAIN and n.op_type in _SAME_SHAPE_AS_QUERY for n in inner) \
                and len({n.input[0] for n in inner}) == 1:
            return dims.get(inner[0].input[0])
        return None
    if node.domain == MS_DOMAIN and node.op_type in _SAME_SHAPE_AS_QUERY:
        return dims.get(node.input[0])
    return None


def _rename_reads(graph: onnx.GraphProto, renames: Dict[str, str]) -> None:
    """Every read of a renamed value, also inside subgraphs (the If branches read outer values)."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _rename_reads(sub, renames)
