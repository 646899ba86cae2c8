"""Sibling projections packed into one MatMul: the MatMuls that read the same input with a
2-D weight initializer each (a layer's query, key and value projections; an MLP's gate and up
projections) become ONE MatMul on the weights concatenated along their output axis, and a
Split gives back each projection's output. A decode step then runs one matrix-vector product
per group instead of one per projection (what ONNX Runtime GenAI's model builder writes by
hand). onnxscript's packed-QKV rule matches only its own GroupQueryAttention pattern, so this
is the one rewrite of our own in the flavor: it reads nothing but MatMuls and initializers."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attn_export.onnx.editing import remove_unused


def pack_projections(model: onnx.ModelProto) -> int:
    """The packed projections in one form, a MatMul [+ bias Add] and a Split: sibling MatMuls
    packed, a model's own packed projection's Slices as a Split, the Split's biases added
    before it (packed_split.py); returns how many rewrites."""
    from attn_export.onnx.ort.packed_split import bias_before_split, slices_as_split

    return pack_sibling_matmuls(model) + slices_as_split(model) + bias_before_split(model)


def pack_sibling_matmuls(model: onnx.ModelProto) -> int:
    """Rewrites ``model`` in place; returns how many groups were packed."""
    weights = {t.name: t for t in model.graph.initializer}
    groups: Dict[str, List[onnx.NodeProto]] = defaultdict(list)
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.input[1] in weights \
                and len(weights[node.input[1]].dims) == 2:
            groups[node.input[0]].append(node)
    packs = {}
    for source, nodes in groups.items():
        same = [n for n in nodes if _compatible(weights[n.input[1]], weights[nodes[0].input[1]])]
        if len(same) > 1:
            packs[id(same[0])] = (source, same)
    if not packs:
        return 0
    packed_ids = {id(n) for _, same in packs.values() for n in same}
    rebuilt: List[onnx.NodeProto] = []
    for node in model.graph.node:
        if id(node) in packs:
            rebuilt.extend(_packed(model, weights, *packs[id(node)]))
        elif id(node) not in packed_ids:
            rebuilt.append(node)
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
    remove_unused(model)
    return len(packs)


def _compatible(a: onnx.TensorProto, b: onnx.TensorProto) -> bool:
    return a.data_type == b.data_type and a.dims[0] == b.dims[0]


def _packed(model: onnx.ModelProto, weights, source: str, nodes: List[onnx.NodeProto]) -> List[onnx.NodeProto]:
    arrays = [numpy_helper.to_array(weights[n.input[1]]) for n in nodes]
    name = f"{nodes[0].name or nodes[0].output[0]}/packed"
    model.graph.initializer.append(numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{name}/weight"))
    sizes = numpy_helper.from_array(np.array([a.shape[1] for a in arrays], dtype=np.int64), f"{name}/sizes")
    model.graph.initializer.append(sizes)
    return [helper.make_node("MatMul", [source, f"{name}/weight"], [f"{name}/out"], name=name),
            helper.make_node("Split", [f"{name}/out", sizes.name], [o for n in nodes for o in n.output],
                             name=f"{name}/split", axis=-1)]
