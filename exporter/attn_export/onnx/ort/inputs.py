"""The inputs the contrib operators read beside query, key and value, built once per model and
shared by the layers that read the same masks:

* ``attention_bias`` [B|1, 1, Lq, Lk] of the node's type: the key-padding mask and attention
  mask added, the query axis spelled out (both operators refuse a bias that broadcasts it), and
  -inf clamped to the type's lowest finite value: a row the mask empties (a left-padded
  prompt's pad queries) then averages its values instead of giving NaN, which would reach the
  valid rows through the next layer's 0 * NaN;
* ``seqlens_k`` [B] int32 and ``total_sequence_length`` (0-D int32) of GroupQueryAttention:
  every row ``total - 1``, the cache read as dense, position ``j`` of the mask is row ``j`` of
  the cache; padding, left or right, is the bias's job. The total is the masks' key length (the
  graph's ``attention_mask`` in a cached decoder), never the cache input's length: with
  ONNX Runtime GenAI's shared buffer the past is allocated at max length.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import onnx
from onnx import TensorProto, helper

from attn_export import spec as _spec
from attn_export.onnx.ort.nodes import attrs
from attn_export.onnx.editing import NodeBuilder

_LOWEST = {TensorProto.FLOAT: float(np.finfo(np.float32).min), TensorProto.FLOAT16: float(np.finfo(np.float16).min),
           TensorProto.BFLOAT16: -3.38e38}


class SharedInputs:
    """The biases and sequence lengths built so far, keyed by what they are built from."""

    def __init__(self):
        self.built: Dict[tuple, object] = {}
        self.nodes = []  # every node built, in an order that is topological for the graph

    def bias(self, node: onnx.NodeProto, elem_type: int, query: str, lq_key: object) -> Optional[str]:
        """The node's masks as one ``attention_bias`` [B|1, 1|H, Lq, Lk], or None (no mask).
        ``lq_key``: the query length's symbol (layers with equal symbols share the bias, built
        from the first one's ``query``), or the query's name where the graph records none."""
        s = _spec.load()
        a = attrs(node)
        kpm = node.input[3] if a[s.attr_has_key_padding_mask] else None
        mask = node.input[4] if a[s.attr_has_attn_mask] else None
        if kpm is None and mask is None:
            return None
        key = ("bias", kpm, mask, elem_type, lq_key)
        if key not in self.built:
            b = NodeBuilder(f"ort_bias_{len(self.built)}")
            self.built[key] = _bias(b, kpm, mask, elem_type, query)
            self.nodes.extend(b.nodes)
        return self.built[key]

    def bias_when(self, bias: str, padded: str, elem_type: int) -> str:
        """``bias`` computed only when ``padded`` holds: the nodes that build it moved into an
        ``If`` whose other branch gives a [1, 1, 1, 1] zero that no one reads (an unpadded batch
        then writes no [B, 1, Lq, Lk] bias: 4 MB per 1k-token prompt). For a bias read only by
        the layers' ``If`` on the same condition (attention.py)."""
        key = ("bias_when", bias, padded)
        if key not in self.built:
            prefix = bias.split("/")[0] + "/"
            moved = [n for n in self.nodes if n.output[0].startswith(prefix)]
            self.nodes = [n for n in self.nodes if not n.output[0].startswith(prefix)]
            out = f"{bias}/when_padded"
            zero = helper.make_node("Constant", [], [f"{out}/unread"],
                                    value=helper.make_tensor(f"{out}/unread", elem_type, [1, 1, 1, 1], [0]))

            def branch(nodes, result, what):
                return helper.make_graph(nodes, f"{out}/{what}", [], [helper.make_tensor_value_info(result, elem_type, None)])

            self.nodes.append(helper.make_node("If", [padded], [out], name=out,
                                               then_branch=branch(moved, bias, "padded"),
                                               else_branch=branch([zero], f"{out}/unread", "dense")))
            self.built[key] = out
        return self.built[key]

    def padded(self, kpm: str) -> str:
        """A bool scalar: whether the additive padding mask ``kpm`` masks any key."""
        key = ("padded", kpm)
        if key not in self.built:
            b = NodeBuilder(f"ort_padded_{len(self.built)}")
            low = b.op("ReduceMin", [kpm], "min", keepdims=0)
            self.built[key] = b.op("Less", [low, b.const("zero", [0.0], dtype=TensorProto.FLOAT, dims=[])], "padded")
            self.nodes.extend(b.nodes)
        return self.built[key]

    def lengths(self, batch_of: str, total_of: tuple) -> tuple:
        """(seqlens_k, total_sequence_length): ``total_of`` is the (value, axis) whose size is
        the total length; ``batch_of`` a value whose axis 0 is the batch (the first caller's
        serves every layer with the same ``total_of``)."""
        key = ("lengths", total_of)
        if key not in self.built:
            b = NodeBuilder(f"ort_lengths_{len(self.built)}")
            total = b.op("Cast", [b.op("Shape", [total_of[0]], "total64", start=total_of[1], end=total_of[1] + 1)],
                         "total1", to=TensorProto.INT32)
            batch = b.op("Shape", [batch_of], "batch", start=0, end=1)
            last = b.op("Sub", [total, b.const("one", [1], dtype=TensorProto.INT32)], "last")
            seqlens = b.op("Expand", [last, batch], "seqlens_k")
            scalar = b.op("Squeeze", [total, b.const("axis0", [0])], "total_sequence_length")
            self.built[key] = (seqlens, scalar)
            self.nodes.extend(b.nodes)
        return self.built[key]


def _bias(b: NodeBuilder, kpm: Optional[str], mask: Optional[str], elem_type: int, query: str) -> str:
    terms = []
    if kpm is not None:  # [B|1, Lk] -> [B|1, 1, 1, Lk]
        terms.append(b.op("Unsqueeze", [kpm, b.const("axes12", [1, 2])], "kpm4"))
    if mask is not None:
        terms.append(mask)
    bias = terms[0] if len(terms) == 1 else b.op("Add", terms, "masks")
    lowest = b.const("lowest", [_LOWEST[TensorProto.FLOAT]], dtype=TensorProto.FLOAT, dims=[])
    bias = b.op("Max", [bias, lowest], "finite")
    # The query axis spelled out: [.., 1|Lq, Lk] -> [.., Lq, Lk].
    lq = b.op("Shape", [query], "lq", start=1, end=2)
    target = b.op("Concat", [b.const("ones2", [1, 1]), lq, b.const("one1", [1])], "bias_shape", axis=0)
    bias = b.op("Expand", [bias, target], "bias_full")
    if elem_type != TensorProto.FLOAT:
        bias = b.op("Max", [b.op("Cast", [bias], "bias_t", to=elem_type),
                            b.const("lowest_t", [_LOWEST[elem_type]], dtype=elem_type, dims=[])], "bias_t_finite")
    return bias
