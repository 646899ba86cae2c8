"""The logits of the last position only: a cached decoder's prefill computes the language-model
head for every prompt token, and generation reads the last one's. Slicing the head's input to
the last position (``Slice(hidden, -1:, axis 1)``, [batch, sequence, hidden] -> [batch, 1,
hidden]) leaves one row of the head's MatMul instead of one per prompt token: with a vocabulary
of tens of thousands of tokens that product is a large share of a prompt's time. ONNX Runtime
GenAI's model builder offers the same (``--extra_options prune_lm_head=true``).

The head is the MatMul (or ONNX Runtime's MatMulNBits) with a constant weight (or the
transposed embedding of tied weights) behind the ``logits`` output, reached through the elementwise ops a model applies to its logits (a
bias, Gemma 2's final soft-capping: Div, Tanh, Mul, a Cast).
"""
from __future__ import annotations

from typing import Optional

import onnx

from attn_export.cache_contract import LOGITS
from attn_export.onnx.editing import GraphIndex, NodeBuilder

HEADS = ("MatMul", "MatMulNBits")
# What a model may do to its logits after the head, each with a constant second operand or none.
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Softcap")
INT64_MAX = 2**63 - 1


def keep_last_position(model: onnx.ModelProto) -> Optional[str]:
    """Slices the head's input to the last position, in place, and gives the ``logits`` output
    a sequence axis of 1; returns None, or why the graph was left as it is."""
    index = GraphIndex(model)
    if LOGITS not in index.graph_outputs:
        return f"no {LOGITS!r} output"
    head = _head(index, LOGITS)
    if head is None:
        return f"no MatMul with a constant weight found behind {LOGITS!r}"
    b = NodeBuilder(f"{head.name or 'lm_head'}/last_position")
    starts, ends, axes = b.const("starts", [-1]), b.const("ends", [INT64_MAX]), b.const("axes", [1])
    last = b.op("Slice", [head.input[0], starts, ends, axes], "hidden")
    head.input[0] = last
    position = list(model.graph.node).index(head)
    for offset, node in enumerate(b.nodes):
        model.graph.node.insert(position + offset, node)
    output = next(o for o in model.graph.output if o.name == LOGITS)
    if output.type.tensor_type.HasField("shape") and len(output.type.tensor_type.shape.dim) == 3:
        output.type.tensor_type.shape.dim[1].Clear()
        output.type.tensor_type.shape.dim[1].dim_value = 1
    return None


def _head(index: GraphIndex, name: str) -> Optional[onnx.NodeProto]:
    """The head producing ``name`` through elementwise ops with constant operands, or None."""
    node = index.producer.get(name)
    while node is not None and node.op_type in ELEMENTWISE:
        variable = [i for i in node.input if i and index.constant(i) is None]
        if len(variable) != 1:
            return None
        node = index.producer.get(variable[0])
    if node is None or node.op_type not in HEADS or len(node.input) < 2 or not _constant(index, node.input[1]):
        return None
    return node if len(index.consumers.get(node.output[0], [])) <= 1 else None


def _constant(index: GraphIndex, name: str) -> bool:
    """A constant, or a Transpose of one (a head tied to the embedding)."""
    transpose = index.made_by(name, "Transpose")
    return index.constant(transpose.input[0] if transpose is not None else name) is not None
