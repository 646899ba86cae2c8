"""The layers' ``If`` nodes on one condition merged into one ``If`` over the rest of the graph:
attention.py writes each layer as an ``If`` on "some key is padded (or the rows' positions
differ)", and the bias is built under the same condition; ONNX Runtime runs an ``If`` as a
subgraph call of its own, which on a small decoder costs about as much per token as the
operators it chooses between (15% of a decode step of the benchmark's 4-layer model). One
``If`` at the first layer takes every node from there on into both of its branches, each with
the layers' own branch inlined: the exact branch (bias, RotaryEmbedding) and the builder's
form. The weights stay initializers of the main graph, read from both branches; the values
each branch makes are renamed with the branch's suffix, so the branches never share a name.
In the unpadded branch every row's last position is the last one: the last-logits pass's
per-row pick (last_logits.rows_last) becomes a plain Slice there.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import onnx
from onnx import helper

from attn_export.onnx.editing import NodeBuilder, remove_unused, replace_nodes
from attn_export.onnx.last_logits import ROWS_LAST, last_position

BRANCHES = (("then_branch", "exact"), ("else_branch", "dense"))


def merge_layer_branches(model: onnx.ModelProto) -> int:
    """Rewrites, in place; returns how many ``If`` nodes became one (0: fewer than two)."""
    nodes = list(model.graph.node)
    condition = _shared_condition(nodes)
    if condition is None:
        return 0
    merged = [n for n in nodes if _is_merged(n, condition)]
    first = next(i for i, n in enumerate(nodes) if n is merged[0])
    rest = nodes[first:]
    made = {o for n in rest for o in n.output if o}
    outputs = [v for v in model.graph.output if v.name in made]
    if len(outputs) != len(model.graph.output) or any(o in _outer_reads(nodes[:first]) for o in made):
        return 0  # a graph output made before the first If, or a value read before it is made
    branches = {attr: _branch(rest, condition, attr, suffix, outputs) for attr, suffix in BRANCHES}
    one = helper.make_node("If", [condition], [v.name for v in outputs], name="ort_layers/if_padded", **branches)
    replace_nodes(model, [*nodes[:first], one])
    remove_unused(model)
    return len(merged)


def _shared_condition(nodes) -> Optional[str]:
    """The condition that two or more top-level ``If`` nodes read, and every ``If`` reads."""
    conditions = [n.input[0] for n in nodes if n.op_type == "If" and n.domain in ("", "ai.onnx")]
    if len(conditions) < 2 or len(set(conditions)) != 1:
        return None
    return conditions[0]


def _is_merged(node: onnx.NodeProto, condition: str) -> bool:
    return node.op_type == "If" and node.domain in ("", "ai.onnx") and node.input[0] == condition


def _outer_reads(nodes) -> set:
    return {i for n in nodes for i in n.input}


def _inlined(node: onnx.NodeProto, attr: str) -> List[onnx.NodeProto]:
    """The nodes of the ``If``'s ``attr`` branch, writing the ``If``'s own output names."""
    graph = next(a.g for a in node.attribute if a.name == attr)
    rename = {v.name: out for v, out in zip(graph.output, node.output)}
    copies = []
    for inner in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        _rename(copy, rename)
        copies.append(copy)
    return copies


def _branch(rest, condition: str, attr: str, suffix: str, outputs) -> onnx.GraphProto:
    """``rest`` with each merged ``If`` replaced by its ``attr`` branch, every value it makes
    renamed ``<name>/<suffix>``, and the graph's outputs as the branch's."""
    body: List[onnx.NodeProto] = []
    for node in rest:
        if _is_merged(node, condition):
            body.extend(_inlined(node, attr))
        elif suffix == "dense" and node.name.endswith(ROWS_LAST):
            b = NodeBuilder(node.name[:-len(ROWS_LAST)] + "/unpadded")
            last_position(b, node.input[0], output=node.output[0])
            body.extend(b.nodes)
        else:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            body.append(copy)
    rename: Dict[str, str] = {o: f"{o}/{suffix}" for n in body for o in n.output if o}
    for node in body:
        _rename(node, rename)
    results = [helper.make_tensor_value_info(rename[v.name], v.type.tensor_type.elem_type, None) for v in outputs]
    return helper.make_graph(_live(body, {r.name for r in results}), f"ort_layers/{suffix}", [], results)


def _live(body: List[onnx.NodeProto], results: set) -> List[onnx.NodeProto]:
    """``body`` without the nodes nothing reads (the other branch's share of an inlined ``If``)."""
    needed, keep = set(results), []
    for node in reversed(body):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(_reads(node))
    return keep[::-1]


def _reads(node: onnx.NodeProto):
    yield from node.input
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for inner in sub.node:
                yield from _reads(inner)


def _rename(node: onnx.NodeProto, names: Dict[str, str]) -> None:
    """Inputs and outputs renamed, in the node and in the subgraphs it holds (outer-scope reads)."""
    for i, name in enumerate(node.input):
        node.input[i] = names.get(name, name)
    for i, name in enumerate(node.output):
        node.output[i] = names.get(name, name)
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for inner in sub.node:
                _rename(inner, names)
            for v in sub.output:
                v.name = names.get(v.name, v.name)
