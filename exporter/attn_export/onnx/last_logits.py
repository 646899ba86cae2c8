"""The logits of the last position only: a cached decoder's prefill computes the language-model
head for every prompt token, and generation reads the last one's. Slicing the head's input to
the last position (``Slice(hidden, -1:, axis 1)``, [batch, sequence, hidden] -> [batch, 1,
hidden]) leaves one row of the head's MatMul instead of one per prompt token: with a vocabulary
of tens of thousands of tokens that product is a large share of a prompt's time. ONNX Runtime
GenAI's model builder offers the same (``--extra_options prune_lm_head=true``).

The head is the MatMul (or ONNX Runtime's MatMulNBits, or its FusedMatMul: the ort flavor's
fusions turn the tied embedding's Transpose into ``transB``) with a constant weight (or the
transposed embedding of tied weights) behind the ``logits`` output, reached through the elementwise ops a model applies to its logits (a
bias, Gemma 2's final soft-capping: Div, Tanh, Mul, a Cast).
"""
from __future__ import annotations

from typing import Optional

import onnx
from onnx import TensorProto

from attn_export.cache_contract import ATTENTION_MASK, LOGITS
from attn_export.onnx.editing import GraphIndex, NodeBuilder

HEADS = ("MatMul", "MatMulNBits", "FusedMatMul")
# What a model may do to its logits after the head, each with a constant second operand or none.
ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Tanh", "Cast", "Softcap")
INT64_MAX = 2**63 - 1
# The name's ending of the node that picks each row's last unpadded position: where no key is
# padded that is the last position of every row, and the ort flavor's unpadded branch
# (ort/one_branch.py) puts a plain Slice in its place.
ROWS_LAST = "/rows_last"


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
    if ATTENTION_MASK in {i.name for i in model.graph.input}:
        head.input[0] = rows_last(b, head.input[0], ATTENTION_MASK)
    else:
        head.input[0] = last_position(b, head.input[0])
    position = list(model.graph.node).index(head)
    for offset, node in enumerate(b.nodes):
        model.graph.node.insert(position + offset, node)
    output = next(o for o in model.graph.output if o.name == LOGITS)
    if output.type.tensor_type.HasField("shape") and len(output.type.tensor_type.shape.dim) == 3:
        output.type.tensor_type.shape.dim[1].Clear()
        output.type.tensor_type.shape.dim[1].dim_value = 1
    return None


def last_position(b: NodeBuilder, hidden: str, output: Optional[str] = None) -> str:
    """``hidden[:, -1:]``: the last position of every row."""
    starts, ends, axes = b.const("starts", [-1]), b.const("ends", [INT64_MAX]), b.const("axes", [1])
    return b.op("Slice", [hidden, starts, ends, axes], "hidden", outputs=[output] if output else None)


def rows_last(b: NodeBuilder, hidden: str, mask: str) -> str:
    """Each row's last position the mask keeps among the call's S new positions (the mask's last
    S columns), ``hidden`` [B, S, H] -> [B, 1, H]: S - 1 in a left-padded or unpadded row, the
    last prompt token in a right-padded one (ONNX Runtime GenAI pads a batch on the right)."""
    length = b.op("Shape", [hidden], "length", start=1, end=2)
    new = b.op("Slice", [mask, b.op("Neg", [length], "from_end"), b.const("to_end", [INT64_MAX]), b.const("axis", [1])],
               "new_columns")
    steps = b.op("Range", [b.const("zero", [0], dims=[]), b.op("Squeeze", [length], "count"), b.const("one", [1], dims=[])],
                 "steps")
    kept = b.op("Mul", [b.op("Cast", [new], "new64", to=TensorProto.INT64), steps], "kept_steps")
    last = b.op("ReduceMax", [kept, b.const("axes", [1])], "last", keepdims=1)
    index = b.op("Unsqueeze", [last, b.const("axis2", [2])], "index")
    return b.op("GatherND", [hidden, index], ROWS_LAST[1:], batch_dims=1)


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
    if any(a.name in ("transA", "transBatchA") and a.i for a in node.attribute):
        return None  # the hidden states enter transposed: their sequence axis is not axis 1
    return node if len(index.consumers.get(node.output[0], [])) <= 1 else None


def _constant(index: GraphIndex, name: str) -> bool:
    """A constant, or a Transpose of one (a head tied to the embedding)."""
    transpose = index.made_by(name, "Transpose")
    return index.constant(transpose.input[0] if transpose is not None else name) is not None
