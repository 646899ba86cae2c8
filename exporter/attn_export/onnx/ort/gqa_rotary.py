"""The rotary embedding and the packed projection inside GroupQueryAttention: where a layer's
query and key come out of ``RotaryEmbedding`` nodes over one packed QKV MatMul's Split, the
GroupQueryAttention of the unpadded branch reads the packed projection itself and rotates
with ``do_rotary`` (ONNX Runtime GenAI's model builder's form: one node per layer between the
QKV MatMul and the output projection, instead of a Split and two RotaryEmbedding).

The caches are rotary.py's: initializers of the model's position limit, read at the graph's
position ids, or, where the limit is unknown, the call's own rows (ids ``0 .. B*S-1``) padded
with zero rows to the total length, which GroupQueryAttention asks of its caches. What the operator does not do: rotate head sizes other than multiples of 16 on the
CPU (such layers keep the exact form on both branches); and rotate a multi-token prompt's rows by positions
that differ between rows (it uses the first row's first id and counts up from there). So the
branch that runs it is taken only when no key is padded and every row has the same position
ids; the layer's ``If`` condition (attention.py) becomes "some key is padded, or the rows'
positions differ", and its other branch keeps the Split, the RotaryEmbeddings and the
operator with the bias, moved inside it so that an unpadded call does not compute them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import onnx
from onnx import TensorProto, helper, numpy_helper

from attn_export.onnx.editing import GraphIndex, NodeBuilder, attr_int, remove_unused, replace_nodes
from attn_export.onnx.ort.nodes import MS_DOMAIN

GQA, ROTARY = "GroupQueryAttention", "RotaryEmbedding"


@dataclass
class _Layer:
    if_node: onnx.NodeProto
    dense: onnx.NodeProto  # the else-branch's GroupQueryAttention
    split: onnx.NodeProto  # the packed projection's Split into query, key, value
    rotaries: tuple  # the query's and the key's RotaryEmbedding
    ids: str
    cos: str
    sin: str


def rotary_into_attention(model: onnx.ModelProto) -> int:
    """Rewrites, in place, each layer found; returns how many."""
    _shapes_from_sources(model)
    index = GraphIndex(model)
    reads = _reads(model.graph)
    layers = [layer for layer in (_match(index, reads, n) for n in model.graph.node) if layer is not None]
    if not layers:
        return 0
    shared: Dict[tuple, tuple] = {}
    moved = {id(n) for layer in layers for n in (layer.split, *layer.rotaries)}
    nodes: List[onnx.NodeProto] = []
    for node in model.graph.node:
        if id(node) in moved:
            continue
        layer = next((x for x in layers if x.if_node is node), None)
        if layer is not None:
            nodes.extend(_caches(shared, layer, index.initializers))
            _rewrite(layer, *shared[("caches", layer.cos, layer.sin, layer.dense.input[6])])
        nodes.append(node)
    conditions = {layer.if_node.input[0] for layer in layers}
    nodes = _widen_conditions(nodes, conditions, {layer.ids: _positions(index, layer.ids) for layer in layers})
    replace_nodes(model, nodes)
    remove_unused(model)
    return len(layers)


def _shapes_from_sources(model: onnx.ModelProto) -> None:
    """``Shape`` of a RotaryEmbedding's output reads its input instead (same shape), and the
    batch and sequence axes of a last-axis Split's output read the Split's input: the lengths
    and the bias take the first layer's batch and query length from its rotated query, which
    would otherwise keep that layer's Split and rotation outside the branch."""
    producer = {o: n for n in model.graph.node for o in n.output}

    def source(name: str, end: Optional[int]) -> str:
        node = producer.get(name)
        if node is not None and node.op_type == ROTARY and node.domain == MS_DOMAIN:
            return source(node.input[0], end)
        if node is not None and node.op_type == "Split" and attr_int(node, "axis", 0) == -1 \
                and end is not None and 0 < end <= 2:
            return node.input[0]
        return name

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
                node.input[0] = source(node.input[0], attr_int(node, "end"))
            for a in node.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    visit(sub)

    visit(model.graph)


def _reads(graph: onnx.GraphProto) -> Dict[str, List[onnx.NodeProto]]:
    """value -> the main graph's nodes that read it, directly or from inside a branch."""
    out: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(_node_reads(node)):
            out.setdefault(name, []).append(node)
    return out


def _node_reads(node: onnx.NodeProto):
    yield from node.input
    for a in node.attribute:
        for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            for inner in sub.node:
                yield from _node_reads(inner)


def _branch_node(if_node: onnx.NodeProto, which: str) -> Optional[onnx.NodeProto]:
    for a in if_node.attribute:
        if a.name == which and len(a.g.node) == 1 and a.g.node[0].op_type == GQA:
            return a.g.node[0]
    return None


def _match(index: GraphIndex, reads, node: onnx.NodeProto) -> Optional[_Layer]:
    if node.op_type != "If":
        return None
    dense, padded = _branch_node(node, "else_branch"), _branch_node(node, "then_branch")
    if dense is None or padded is None or attr_int(dense, "do_rotary", 0) or list(dense.input[:3]) != list(padded.input[:3]):
        return None
    q, k, v = dense.input[:3]
    rq, rk = index.producer.get(q), index.producer.get(k)
    if any(r is None or r.op_type != ROTARY or r.domain != MS_DOMAIN for r in (rq, rk)):
        return None
    if list(rq.input[1:4]) != list(rk.input[1:4]) or attr_int(rq, "interleaved", 0) != attr_int(rk, "interleaved", 0) \
            or any(attr_int(r, "rotary_embedding_dim", 0) or attr_int(r, "is_packed_batching", 0) for r in (rq, rk)):
        return None
    split = index.producer.get(rq.input[0])
    if split is None or split.op_type != "Split" or list(split.output) != [rq.input[0], rk.input[0], v]:
        return None
    sizes = index.initializers.get(split.input[1]) if len(split.input) > 1 else None
    heads = attr_int(dense, "num_heads", 0)
    if sizes is None or not heads or int(numpy_helper.to_array(sizes)[0]) % (16 * heads):
        return None  # the CPU kernel rotates head sizes that are multiples of 16 only
    # Everything moved into the branch is read by this layer's If and by nothing else.
    private = [*split.output, rq.output[0], rk.output[0]]
    if any([id(r) for r in reads.get(name, [])] != [id(n)] for name, n in zip(private, [rq, rk, node, node, node])):
        return None
    if any(name in index.graph_outputs for name in private):
        return None
    return _Layer(node, dense, split, (rq, rk), rq.input[1], rq.input[2], rq.input[3])


def _caches(shared: Dict[tuple, tuple], layer: _Layer, fixed) -> List[onnx.NodeProto]:
    """The cos/sin caches with zero rows up to the total length (once per pair of caches)."""
    key = ("caches", layer.cos, layer.sin, layer.dense.input[6])
    if key in shared:
        return []
    if layer.cos in fixed and layer.sin in fixed:  # rotary.py's initializers of the model's position limit
        shared[key] = (layer.cos, layer.sin)
        return []
    b = NodeBuilder(f"{layer.cos}/to_total")
    rows = b.op("Shape", [layer.cos], "rows", start=0, end=1)
    total = b.op("Reshape", [b.op("Cast", [layer.dense.input[6]], "total64", to=TensorProto.INT64),
                             b.const("one_d", [1])], "total1")
    extra = b.op("Max", [b.op("Sub", [total, rows], "missing"), b.const("zero", [0])], "extra")
    pads = b.op("Concat", [b.const("before", [0, 0]), extra, b.const("after", [0])], "pads", axis=0)
    shared[key] = (b.op("Pad", [layer.cos, pads], "cos"), b.op("Pad", [layer.sin, pads], "sin"))
    return b.nodes


def _rewrite(layer: _Layer, cos: str, sin: str) -> None:
    """The else-branch reads the packed projection and rotates; the then-branch computes the
    Split and the rotations it reads."""
    dense, packed = layer.dense, layer.split.input[0]
    inputs = [packed, "", "", *dense.input[3:7], cos, sin, layer.ids]
    attributes = {a.name: helper.get_attribute_value(a) for a in dense.attribute}
    attributes.update(do_rotary=1, rotary_interleaved=attr_int(layer.rotaries[0], "interleaved", 0))
    rotating = helper.make_node(GQA, inputs, list(dense.output), name=dense.name, domain=MS_DOMAIN, **attributes)
    for a in layer.if_node.attribute:
        if a.name == "else_branch":
            del a.g.node[:]
            a.g.node.append(rotating)
        elif a.name == "then_branch":
            exact = list(a.g.node)
            del a.g.node[:]
            a.g.node.extend([layer.split, *layer.rotaries, *exact])


def _positions(index: GraphIndex, ids: str) -> Optional[str]:
    """The graph's position ids behind rotary.py's ``Reshape(Range(..), Shape(positions))``."""
    reshape = index.made_by(ids, "Reshape")
    shape = index.made_by(reshape.input[1], "Shape") if reshape is not None else None
    if reshape is not None and index.made_by(reshape.input[0], "Range") is not None:
        return shape.input[0] if shape is not None else None
    return ids  # the graph's own position ids (rotary.py's caches of the position limit)


def _widen_conditions(nodes: List[onnx.NodeProto], conditions, positions: Dict[str, Optional[str]]) -> list:
    """Each layer condition ``padded`` -> ``Or(padded, the rows' positions differ)``, read by
    every ``If`` on it (the bias is built under the same condition as the layers that read it)."""
    sources = sorted({p for p in positions.values() if p is not None})
    if len(sources) != 1 or len(positions) != sum(1 for p in positions.values() if p is not None):
        raise ValueError("the rotary caches' position ids are not one graph value")
    b = NodeBuilder("ort_rows_differ")
    pos = sources[0]
    first = b.op("Slice", [pos, b.const("start", [0]), b.const("end", [1]), b.const("axis", [0])], "first_row")
    spread = b.op("ReduceMax", [b.op("Abs", [b.op("Sub", [pos, first], "offset")], "distance")], "spread", keepdims=0)
    differ = b.op("Greater", [spread, b.const("zero", [0], dims=[])], "differ")
    widened = {c: b.op("Or", [c, differ], f"{c.replace('/', '_')}_or_differ") for c in sorted(conditions)}
    out: List[onnx.NodeProto] = []
    placed = False
    for node in nodes:
        if node.op_type == "If" and node.input[0] in widened:
            if not placed:
                out.extend(b.nodes)
                placed = True
            node.input[0] = widened[node.input[0]]
        out.append(node)
    return out
