"""Reading and editing an exported ``onnx.ModelProto`` in place: the one set of helpers every
graph pass (``attn_export.onnx.passes``) uses, in the spirit of ONNX Runtime's ``OnnxModel``.

* :class:`NodeBuilder`: new nodes with names unique to the node they replace;
* :class:`GraphIndex`: who produces and who reads each value, which values are graph inputs,
  and the matchers (:meth:`GraphIndex.made_by`, :meth:`GraphIndex.past_concat`);
* :func:`find_past`, :func:`sequence_first`, :func:`drop_concats`: a cached export's
  Concat(past, new) chain, which both attention flavors fold into their nodes;
* :func:`replace_nodes`, :func:`remove_unused`: rewriting the node list, dead-node removal;
* :func:`attr_ints`, :func:`attr_int`, :func:`attr_value`: attribute readers;
* :func:`value_types`, :func:`value_dims`: what the graph records of each value;
* :func:`attention_nodes`, :func:`count_attention_nodes`: the FusedAttention nodes (any of
  their domains).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import onnx
from onnx import TensorProto, helper

from attn_export import spec as _spec
from attn_export.onnx.node import is_attention_domain

DEFAULT_DOMAINS = ("", "ai.onnx")
TO_SEQUENCE_FIRST = [0, 2, 1, 3]  # [B, H, L, D] <-> [B, L, H, D]


def attr_value(node: onnx.NodeProto, name: str, default=None):
    """The value of the node's attribute ``name`` (a Python value), or ``default``."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def attr_int(node: onnx.NodeProto, name: str, default: Optional[int] = None) -> Optional[int]:
    return attr_value(node, name, default)


def attr_ints(node: onnx.NodeProto, name: str) -> Optional[List[int]]:
    value = attr_value(node, name)
    return None if value is None else list(value)


def attention_nodes(model: onnx.ModelProto) -> List[onnx.NodeProto]:
    """The graph's FusedAttention nodes, in the spec's domain or a variant's."""
    s = _spec.load()
    return [n for n in model.graph.node if n.op_type == s.op_type and is_attention_domain(n.domain)]


def count_attention_nodes(model: onnx.ModelProto) -> int:
    return len(attention_nodes(model))


def value_types(model: onnx.ModelProto) -> Dict[str, int]:
    """Element type of every graph value whose type the graph records (inputs, initializers,
    value_info, outputs)."""
    types = {i.name: i.data_type for i in model.graph.initializer}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    return types


def value_dims(model: onnx.ModelProto) -> Dict[str, List[object]]:
    """Shape of every graph value whose shape the graph records: per axis a size (int), a
    symbol (str; equal symbols are equal sizes) or None (unknown)."""
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            dims[value.name] = [dim_of(d) for d in value.type.tensor_type.shape.dim]
    return dims


def dim_of(d) -> object:
    """One axis of a recorded shape: its symbol, its size, or None."""
    return d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)


class NodeBuilder:
    """Nodes for one rewritten node, with names unique to it (``prefix/what``)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: List[onnx.NodeProto] = []

    def name(self, what: str) -> str:
        return f"{self.prefix}/{what}"

    def const(self, what: str, values, dtype=TensorProto.INT64, dims=None) -> str:
        out = self.name(what)
        dims = [len(values)] if dims is None else dims
        self.nodes.append(helper.make_node("Constant", [], [out], name=out,
                                           value=helper.make_tensor(out, dtype, dims, values)))
        return out

    def op(self, op_type: str, inputs: List[str], what: str, outputs: List[str] | None = None, **attrs) -> str:
        outs = outputs or [self.name(what)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(what), **attrs))
        return outs[0]


class GraphIndex:
    """Who produces and who reads each value, and which values are graph inputs (a snapshot:
    build a new one after editing the graph)."""

    def __init__(self, model: onnx.ModelProto):
        self.producer: Dict[str, onnx.NodeProto] = {o: n for n in model.graph.node for o in n.output}
        self.consumers: Dict[str, List[onnx.NodeProto]] = {}
        for node in model.graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.graph_inputs = {v.name for v in model.graph.input}
        self.graph_outputs = {v.name for v in model.graph.output}
        self.initializers = {i.name: i for i in model.graph.initializer}

    def made_by(self, name: str, op_type: str) -> Optional[onnx.NodeProto]:
        """The default-domain node of ``op_type`` producing ``name``, or None."""
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in DEFAULT_DOMAINS else None

    def constant(self, name: str):
        """The value of an initializer or a ``Constant`` node's ``value`` as a numpy array, or None."""
        from onnx import numpy_helper

        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.made_by(name, "Constant")
        if node is not None and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def past_concat(self, name: str) -> Optional[onnx.NodeProto]:
        """The Concat(past graph input, new, axis 2) behind a node's key or value input, read
        through Transpose(0, 2, 1, 3) and Reshape, or None."""
        reshape = self.made_by(name, "Reshape")
        transpose = self.made_by(reshape.input[0], "Transpose") if reshape is not None else None
        if transpose is None or attr_ints(transpose, "perm") != TO_SEQUENCE_FIRST:
            return None
        concat = self.made_by(transpose.input[0], "Concat")
        if concat is None or len(concat.input) != 2 or attr_int(concat, "axis") not in (2, -2):
            return None
        return concat if concat.input[0] in self.graph_inputs else None


@dataclass(frozen=True)
class PastFold:
    """One layer's cache, as a node that folds the Concat(past, new) reads and writes it."""

    past_key: str
    past_value: str
    new_key: str  # [B, Hkv, S, D], the Concat's second input
    new_value: str
    present_key: str  # the Concat's output: the node's output now
    present_value: str
    concats: tuple  # the two Concat nodes, which the node replaces


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


def sequence_first(b: NodeBuilder, new: str, what: str) -> str:
    """[B, Hkv, S, D] -> [B, S, Hkv*D], the layout of the node's key and value inputs."""
    transposed = b.op("Transpose", [new], f"{what}_new_t", perm=TO_SEQUENCE_FIRST)
    return b.op("Reshape", [transposed, b.const(f"{what}_new_shape", [0, 0, -1])], f"{what}_new")


def drop_concats(nodes: Iterable[onnx.NodeProto], folds: Iterable[PastFold]) -> list:
    """``nodes`` without the Concats the folded nodes replace (their outputs are the nodes' now)."""
    gone = {id(c) for fold in folds for c in fold.concats}
    return [n for n in nodes if id(n) not in gone]


def replace_nodes(model: onnx.ModelProto, nodes: Iterable[onnx.NodeProto]) -> None:
    """The graph's node list, replaced by ``nodes`` (in order)."""
    nodes = list(nodes)
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def read_names(graph: onnx.GraphProto):
    """Every value name the graph's nodes read, also from inside subgraphs (If/Loop bodies)."""
    for node in graph.node:
        yield from node.input
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from read_names(sub)


def drop_unread_input(model: onnx.ModelProto, name: str) -> bool:
    """Removes the graph input ``name`` when no node reads it; returns whether it went."""
    graph = model.graph
    if name not in {i.name for i in graph.input} or name in set(read_names(graph)) | {o.name for o in graph.output}:
        return False
    kept = [i for i in graph.input if i.name != name]
    del graph.input[:]
    graph.input.extend(kept)
    return True


def remove_unused(model: onnx.ModelProto) -> None:
    """Drops nodes and initializers nothing reads (the placeholder masks of converted nodes)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        used = set(read_names(graph)) | outputs
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            break
        replace_nodes(model, keep)
    initializers = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
