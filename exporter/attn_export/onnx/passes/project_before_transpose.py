"""project_before_transpose: ``graph input -> Transpose -> MatMul(., fp16 W)`` rewritten as
``MatMul -> Transpose``, the order ONNX Runtime 1.32 (CPU) runs without crashing."""
from __future__ import annotations

import onnx

from attn_export.onnx.editing import DEFAULT_DOMAINS, attr_ints, replace_nodes
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome

NOTE = ("an fp16 projection of a transposed graph input now runs before the transpose (the other "
        "order crashes ONNX Runtime 1.32 at its default optimization level; docs/onnx_node.md)")


class ProjectBeforeTranspose(GraphPass):
    name = "project_before_transpose"

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        moved = project_before_transposing_inputs(model)
        return PassOutcome(moved, (NOTE,) if moved else ())


def project_before_transposing_inputs(model: onnx.ModelProto) -> int:
    """Rewrites ``graph input -> Transpose(perm) -> MatMul(., W)`` (W a 2-D float16 initializer,
    ``perm`` keeping the last axis in place) as ``MatMul(input, W) -> Transpose(perm)``: the same
    math, since MatMul with a 2-D right operand acts on the last axis alone. ONNX Runtime 1.32
    (CPU) segfaults at its default optimization level on the first form (docs/onnx_node.md,
    "ONNX Runtime: Transpose -> MatMul on a graph input"); user models write it whenever they
    transpose a sequence-first input before an fp16 nn.Linear. Returns how many MatMuls moved."""
    transposes = _input_transposes(model)
    weights = {i.name: i for i in model.graph.initializer}
    moved = 0
    nodes = []
    for node in model.graph.node:
        found = transposes.get(node.input[0]) if node.op_type == "MatMul" and node.input else None
        weight = weights.get(node.input[1]) if found else None
        if weight is None or len(weight.dims) != 2 or weight.data_type != onnx.TensorProto.FLOAT16:
            nodes.append(node)
            continue
        transpose, perm = found
        projected = f"{node.output[0]}__before_transpose"
        nodes.append(onnx.helper.make_node("MatMul", [transpose.input[0], node.input[1]], [projected],
                                           name=f"{node.name}__projected" if node.name else ""))
        nodes.append(onnx.helper.make_node("Transpose", [projected], list(node.output), perm=perm,
                                           name=f"{node.name}__transposed" if node.name else ""))
        moved += 1
    if moved:
        _drop_unread_transposes(model, nodes, transposes)
    return moved


def _input_transposes(model: onnx.ModelProto) -> dict:
    """output -> (node, perm) of each Transpose of a graph input that keeps the last axis."""
    inputs = {v.name for v in model.graph.input}
    transposes = {}
    for node in model.graph.node:
        if node.op_type == "Transpose" and node.domain in DEFAULT_DOMAINS and node.input[0] in inputs:
            perm = attr_ints(node, "perm")
            if perm and perm[-1] == len(perm) - 1:
                transposes[node.output[0]] = (node, perm)
    return transposes


def _drop_unread_transposes(model: onnx.ModelProto, nodes: list, transposes: dict) -> None:
    """The graph's nodes are ``nodes`` without the input Transposes nothing reads any more."""
    used = {name for n in nodes for name in n.input} | {o.name for o in model.graph.output}
    kept = [n for n in nodes if not (n.op_type == "Transpose" and n.output[0] in transposes
                                     and n.output[0] not in used)]
    dropped = {n.output[0] for n in nodes if n not in kept}
    replace_nodes(model, kept)
    info = [v for v in model.graph.value_info if v.name not in dropped]
    del model.graph.value_info[:]
    model.graph.value_info.extend(info)
