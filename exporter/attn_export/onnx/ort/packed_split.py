"""A packed projection's outputs as one Split on the packed MatMul, whatever form the export
gave them, so that the packed QKV reaches GroupQueryAttention (gqa_rotary.py):

* :func:`slices_as_split`: contiguous Slices of one value along its last axis that cover it
  (a model whose own Linear is packed, e.g. Phi-3's ``qkv_proj`` cut by ``[..., a:b]``);
* :func:`bias_before_split`: a Split whose every output is read by one Add of a 1-D constant
  bias (a model with Q/K/V biases, e.g. Qwen2) -> the biases concatenated and added before the
  Split: one Add instead of three, and the Split's input is the biased packed projection.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attn_export.onnx.editing import GraphIndex, attr_int, remove_unused, replace_nodes, value_dims


def slices_as_split(model: onnx.ModelProto) -> int:
    """Rewrites, in place; returns how many groups of Slices became a Split."""
    index = GraphIndex(model)
    groups: Dict[str, List[tuple]] = {}
    for node in model.graph.node:
        bounds = _last_axis_slice(index, node)
        if bounds is not None:
            groups.setdefault(node.input[0], []).append((*bounds, node))
    splits = {}
    for source, parts in groups.items():
        width = _last_dim(index, source)
        if width is None:
            continue
        parts = sorted(((start, min(end, width), node) for start, end, node in parts), key=lambda p: p[:2])  # end: INT64_MAX for "to the end"
        starts_ok = all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        if len(parts) > 1 and parts[0][0] == 0 and starts_ok and parts[-1][1] == width:
            splits[id(parts[0][2])] = (source, parts)
    if not splits:
        return 0
    gone = {id(p[2]) for _, parts in splits.values() for p in parts}
    nodes = []
    for node in model.graph.node:
        if id(node) in splits:
            source, parts = splits[id(node)]
            nodes.extend(_split(model, source, [end - start for start, end, _ in parts], [p[2].output[0] for p in parts]))
        elif id(node) not in gone:
            nodes.append(node)
    replace_nodes(model, nodes)
    remove_unused(model)
    return len(splits)


def bias_before_split(model: onnx.ModelProto) -> int:
    """Rewrites, in place; returns how many Splits took their outputs' biases."""
    index = GraphIndex(model)
    moves = {}
    for node in model.graph.node:
        sizes = _split_sizes(index, node)
        if sizes is None:
            continue
        adds = [_bias_add(index, out, size) for out, size in zip(node.output, sizes)]
        if all(a is not None for a in adds):
            moves[id(node)] = (node, adds)
    if not moves:
        return 0
    gone = {id(add) for _, adds in moves.values() for add, _ in adds}
    nodes = []
    for node in model.graph.node:
        if id(node) in moves:
            split, adds = moves[id(node)]
            name = f"{split.name or split.output[0]}/bias"
            bias = numpy_helper.from_array(np.concatenate([b for _, b in adds]), f"{name}/packed")
            model.graph.initializer.append(bias)
            nodes.append(helper.make_node("Add", [split.input[0], bias.name], [f"{name}/out"], name=name))
            nodes.append(helper.make_node("Split", [f"{name}/out", *split.input[1:]], [a.output[0] for a, _ in adds],
                                          name=split.name, axis=-1))
        elif id(node) not in gone:
            nodes.append(node)
    replace_nodes(model, nodes)
    remove_unused(model)
    return len(moves)


def _split(model: onnx.ModelProto, source: str, sizes: List[int], outputs: List[str]) -> list:
    name = f"{outputs[0]}/as_split"
    tensor = numpy_helper.from_array(np.array(sizes, dtype=np.int64), f"{name}/sizes")
    model.graph.initializer.append(tensor)
    return [helper.make_node("Split", [source, tensor.name], outputs, name=name, axis=-1)]


def _last_axis_slice(index: GraphIndex, node: onnx.NodeProto) -> Optional[tuple]:
    """(start, end) of a step-1 Slice along the last axis of a 3-D value, or None."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.input) < 4:
        return None
    values = [index.constant(i) if i else np.array([1]) for i in node.input[1:5]]
    if len(values) == 3:
        values.append(np.array([1]))
    if any(v is None or v.size != 1 for v in values):
        return None
    start, end, axis, step = (int(v.reshape(-1)[0]) for v in values)
    rank = _rank(index, node.input[0])
    if step != 1 or rank is None or axis not in (-1, rank - 1) or start < 0 or end < start:
        return None
    return start, end


def _rank(index: GraphIndex, name: str) -> Optional[int]:
    producer = index.producer.get(name)
    if producer is not None and producer.op_type == "MatMul" and producer.input[1] in index.initializers:
        return 3  # a projection of [B, S, hidden]
    return None


def _last_dim(index: GraphIndex, name: str) -> Optional[int]:
    producer = index.producer.get(name)
    if producer is not None and producer.op_type == "MatMul" and producer.input[1] in index.initializers:
        return int(index.initializers[producer.input[1]].dims[-1])
    return None


def _split_sizes(index: GraphIndex, node: onnx.NodeProto) -> Optional[List[int]]:
    if node.op_type != "Split" or node.domain not in ("", "ai.onnx") or attr_int(node, "axis", 0) != -1 \
            or len(node.input) < 2:
        return None
    sizes = index.constant(node.input[1])
    return [int(s) for s in sizes.reshape(-1)] if sizes is not None and sizes.size == len(node.output) else None


def _bias_add(index: GraphIndex, value: str, size: int) -> Optional[tuple]:
    """(the Add, its bias array) when ``value``'s one reader adds a 1-D constant of ``size``."""
    readers = index.consumers.get(value, [])
    if len(readers) != 1 or value in index.graph_outputs or readers[0].op_type != "Add":
        return None
    add = readers[0]
    other = add.input[1] if add.input[0] == value else add.input[0]
    bias = index.constant(other)
    if bias is None or bias.ndim != 1 or bias.shape[0] != size:
        return None
    return add, bias


def split_as_matmuls(model: onnx.ModelProto) -> int:
    """A Split on the last axis of a packed projection (a MatMul of a 2-D weight initializer, its
    bias Add if any) that no operator reads packed (an MLP's gate and up, once
    GroupQueryAttention took the packed Q/K/V): one MatMul [+ Add] per output, on the weight's
    (and bias') columns. Rewrites, in place; returns how many Splits went."""
    index, dims = GraphIndex(model), value_dims(model)
    plans = {}
    for node in model.graph.node:
        packed = _packed_projection(index, node.input[0]) if node.op_type == "Split" else None
        if packed is None:
            continue
        last = len(dims.get(node.input[0], [])) - 1  # -1 where the graph records no shape
        sizes = _split_widths(index, node, packed[1].shape[1], last)
        if sizes is not None:
            plans[id(node)] = (node, sizes, *packed)
    if not plans:
        return 0
    nodes = []
    for node in model.graph.node:
        if id(node) not in plans:
            nodes.append(node)
            continue
        split, sizes, matmul, weight, bias = plans[id(node)]
        edges = np.cumsum([0, *sizes])
        for k, out in enumerate(split.output):
            name = f"{matmul.name or matmul.output[0]}/part{k}"
            columns = slice(int(edges[k]), int(edges[k + 1]))
            part = np.ascontiguousarray(weight[:, columns])
            model.graph.initializer.append(numpy_helper.from_array(part, f"{name}/weight"))
            if bias is None:
                nodes.append(helper.make_node("MatMul", [matmul.input[0], f"{name}/weight"], [out], name=name))
                continue
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(bias[columns]), f"{name}/bias"))
            nodes.append(helper.make_node("MatMul", [matmul.input[0], f"{name}/weight"], [f"{name}/out"], name=name))
            nodes.append(helper.make_node("Add", [f"{name}/out", f"{name}/bias"], [out], name=f"{name}/add"))
    replace_nodes(model, nodes)
    remove_unused(model)  # the packed MatMul (and its Add), read by the Split alone
    return len(plans)


def _split_widths(index: GraphIndex, node: onnx.NodeProto, width: int, last: int) -> Optional[List[int]]:
    """The widths a default-domain Split cuts a projection [..., width] into along its last axis
    (``-1``, or ``last``: the rank the graph records less one), from its sizes input or
    ``num_outputs`` equal parts; None for any other Split."""
    if node.domain not in ("", "ai.onnx") or attr_int(node, "axis", 0) not in (-1, last):
        return None
    if len(node.input) > 1 and node.input[1]:
        sizes = index.constant(node.input[1])
        sizes = [int(v) for v in sizes.reshape(-1)] if sizes is not None else None
    else:
        parts = attr_int(node, "num_outputs", len(node.output))
        sizes = [width // parts] * parts if parts and width % parts == 0 else None
    return sizes if sizes is not None and len(sizes) == len(node.output) and sum(sizes) == width else None


def _packed_projection(index: GraphIndex, value: str) -> Optional[tuple]:
    """(the MatMul, its weight, the bias or None) when ``value`` is a projection read by one
    node: ``MatMul(x, W)`` or ``Add(MatMul(x, W), b)``, W a 2-D and b a 1-D constant."""
    if len(index.consumers.get(value, [])) != 1 or value in index.graph_outputs:
        return None
    node, bias = index.producer.get(value), None
    if node is not None and node.op_type == "Add" and node.domain in ("", "ai.onnx"):
        bias = index.constant(node.input[1])
        inner = node.input[0]
        if bias is None or bias.ndim != 1 or len(index.consumers.get(inner, [])) != 1:
            return None
        node = index.producer.get(inner)
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") \
            or node.input[1] not in index.initializers:
        return None
    weight = numpy_helper.to_array(index.initializers[node.input[1]])
    if weight.ndim != 2 or (bias is not None and bias.shape[0] != weight.shape[1]):
        return None
    return node, weight, bias
