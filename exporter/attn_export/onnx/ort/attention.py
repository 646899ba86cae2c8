"""Each FusedAttention node to ONNX Runtime's contrib operator that computes it:

* causal self-attention, with its cache (the cache form, custom_past.py) or without, ->
  ``com.microsoft.GroupQueryAttention``: grouped-query heads (``kv_num_heads``), sliding window
  (``local_window_size`` = the node's ``window``: both count the key on the diagonal), soft-cap
  before the masks (``softcap``), the masks as ``attention_bias`` (inputs.py);
* non-causal attention without a cache (encoders, cross-attention, arbitrary masks and biases)
  whose key/value heads are the query heads -> ``com.microsoft.MultiHeadAttention``;
* anything else keeps the portable node, and :func:`why_not_ort` says why.

A cached layer with a padding mask alone is an ``If`` on "some key is padded": its then-branch
is the GroupQueryAttention with the bias, its else-branch the same without (what an unpadded
batch runs, at the operator's full speed; compact_rows.py replaces the Ifs by the latter
over a compacted cache where every layer is one). Both operators read query, key and value as the node does ([B, L, heads * D], token-major) and
the cache head-major ([B, Hkv, P, D], Optimum's and the node's layout), so no data moves.
Where the operators differ from the node: a query row the masks empty (a left-padded prompt's
pad positions) averages the values instead of giving zeros (inputs.py); GroupQueryAttention on
the CPU runs a prompt longer than one token over a non-empty past only at batch 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import onnx
from onnx import TensorProto, helper

from attn_export import spec as _spec
from attn_export.onnx.editing import NodeBuilder, attention_nodes, remove_unused, value_dims, value_types
from attn_export.onnx.ort.inputs import SharedInputs
from attn_export.onnx.ort.nodes import MS_DOMAIN, attrs, import_ms_domain

GQA, MHA = "GroupQueryAttention", "MultiHeadAttention"
_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)  # what both operators' CPU kernels run


@dataclass
class OrtLowering:
    converted: dict = field(default_factory=dict)  # contrib op type -> count
    kept: List[str] = field(default_factory=list)  # "node <name>: <reason>" for each node left custom
    total_from_mask: bool = True  # every GroupQueryAttention reads its total length off a mask

    @property
    def all_gqa(self) -> bool:
        """Every attention of the model is a GroupQueryAttention (a shared past/present buffer fits)."""
        return not self.kept and set(self.converted) == {GQA} and self.total_from_mask


def _op_for(node: onnx.NodeProto, dims, types) -> tuple:
    """(the contrib op type, None) or (None, why the node stays custom)."""
    s = _spec.load()
    a = attrs(node)
    if types.get(node.input[0]) not in _TYPES:
        return None, "the contrib operators' CPU kernels run float32 and float16 only"
    if len(a[s.attr_alibi_slopes]):  # never dropped: the node keeps them until this flavor expresses them
        return None, "ALiBi slopes (alibi_slopes): the ort flavor does not express them yet"
    if a[s.attr_is_causal]:
        if a[s.attr_has_past] or int(a[s.attr_causal_alignment]) == 1 or _same_length(dims, node):
            return GQA, None
        return None, ("top-left causal masking over keys of another length: GroupQueryAttention aligns its "
                      "causal mask bottom-right")
    if a[s.attr_has_past]:
        return None, "a non-causal cache: MultiHeadAttention's cache is another layout"
    if int(a[s.attr_window]) > 0:
        return None, f"sliding window (window={int(a[s.attr_window])}) without causal masking"
    if float(a[s.attr_softcap]) > 0:
        return None, "soft-capping without causal masking: MultiHeadAttention has no soft-cap"
    heads, kv_heads = int(a[s.attr_num_heads]), int(a[s.attr_kv_num_heads])
    if kv_heads and kv_heads != heads:
        return None, (f"grouped-query heads ({heads} over {kv_heads}) without causal masking: MultiHeadAttention "
                      "needs one key/value head per query head")
    return MHA, None


def why_not_ort(model: onnx.ModelProto, node: onnx.NodeProto) -> Optional[str]:
    """Why no contrib operator computes this node, or None."""
    return _op_for(node, value_dims(model), value_types(model))[1]


def _same_length(dims, node: onnx.NodeProto) -> bool:
    q, k = dims.get(node.input[0]), dims.get(node.input[1])
    return bool(q and k and len(q) > 1 and len(k) > 1 and q[1] is not None and q[1] == k[1])


def lower_attention(model: onnx.ModelProto) -> OrtLowering:
    """Rewrites, in place, every FusedAttention node that a contrib operator computes; the nodes
    left are the portable node (their functions are attached after, graph.attach_function)."""
    dims, types = value_dims(model), value_types(model)
    shared, out = SharedInputs(), OrtLowering()
    nodes: List[onnx.NodeProto] = []
    found = attention_nodes(model)  # held: protobuf keeps one wrapper per element only while it lives
    targets = {id(n) for n in found}
    for node in model.graph.node:
        if id(node) not in targets:
            nodes.append(node)
            continue
        op, why = _op_for(node, dims, types)
        if op is None:
            out.kept.append(f"node {node.name}: {why}")
            nodes.append(node)
            continue
        elem = types[node.input[0]]
        lq = dims.get(node.input[0], [None, None])[1] if len(dims.get(node.input[0], [])) > 1 else None
        lq_key = lq if isinstance(lq, (str, int)) and lq != "" else node.input[0]
        built = _gqa(node, shared, elem, lq_key, out) if op == GQA else _mha(node, shared, elem, lq_key)
        nodes.extend(shared.nodes)
        shared.nodes = []
        nodes.append(built)
        out.converted[op] = out.converted.get(op, 0) + 1
    if out.converted:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        import_ms_domain(model)
        remove_unused(model)
    return out


def _gqa(node: onnx.NodeProto, shared: SharedInputs, elem: int, lq_key, out: OrtLowering) -> onnx.NodeProto:
    s = _spec.load()
    a = attrs(node)
    past = bool(a[s.attr_has_past])
    q, k, v = node.input[:3]
    if a[s.attr_has_key_padding_mask]:
        total_of = (node.input[3], 1)  # the masks' key length: past + new
    elif past:  # the past's own length: wrong under a shared max-length buffer
        total_of, out.total_from_mask = None, False
    else:
        total_of = (k, 1)
    if total_of is None:
        seqlens, total = _lengths_from_past(shared, node)
    else:
        seqlens, total = shared.lengths(q, total_of)
    bias = shared.bias(node, elem, q, lq_key) or ""
    past_inputs = [node.input[5], node.input[6]] if past else ["", ""]
    outputs = list(node.output) if past else [node.output[0]]
    heads = int(a[s.attr_num_heads])
    window = int(a[s.attr_window])

    def gqa(with_bias: bool, names, bias=bias) -> onnx.NodeProto:
        extra = ["", "", "", bias] if with_bias else []
        return helper.make_node(
            GQA, [q, k, v, *past_inputs, seqlens, total, *extra], names, name=node.name, domain=MS_DOMAIN,
            num_heads=heads, kv_num_heads=int(a[s.attr_kv_num_heads]) or heads, scale=float(a[s.attr_scale]),
            softcap=float(a[s.attr_softcap]), local_window_size=window if window > 0 else -1)

    if not bias:
        return gqa(False, outputs)
    if a[s.attr_has_attn_mask]:
        return gqa(True, outputs)
    # A padding mask alone: the bias only where some row is padded. GroupQueryAttention with a
    # bias runs its prompt 20-30% slower (1-4k tokens, 2 threads), and an unpadded batch is
    # what generation runtimes run at batch 1.
    padded = shared.padded(node.input[3])
    bias = shared.bias_when(bias, padded, elem)
    return helper.make_node("If", [padded], outputs, name=f"{node.name}/if_padded",
                            then_branch=_branch(gqa(True, [f"{o}/padded" for o in outputs], bias), elem, "padded"),
                            else_branch=_branch(gqa(False, [f"{o}/dense" for o in outputs]), elem, "dense"))


def _branch(node: onnx.NodeProto, elem: int, what: str) -> onnx.GraphProto:
    return helper.make_graph([node], f"{node.name}/{what}", [],
                             [helper.make_tensor_value_info(o, elem, None) for o in node.output])


def _lengths_from_past(shared: SharedInputs, node: onnx.NodeProto) -> tuple:
    """Total = the past's length + the new tokens', for a cached node without a padding mask."""

    b = NodeBuilder(f"{node.name}/ort_lengths")
    parts = [b.op("Shape", [node.input[5]], "p", start=2, end=3), b.op("Shape", [node.input[1]], "s", start=1, end=2)]
    total = b.op("Cast", [b.op("Add", parts, "t64")], "t1", to=TensorProto.INT32)
    batch = b.op("Shape", [node.input[0]], "batch", start=0, end=1)
    seqlens = b.op("Expand", [b.op("Sub", [total, b.const("one", [1], dtype=TensorProto.INT32)], "last"), batch],
                   "seqlens_k")
    scalar = b.op("Squeeze", [total, b.const("axis0", [0])], "total_sequence_length")
    shared.nodes.extend(b.nodes)
    return seqlens, scalar


def _mha(node: onnx.NodeProto, shared: SharedInputs, elem: int, lq_key) -> onnx.NodeProto:
    s = _spec.load()
    a = attrs(node)
    bias = shared.bias(node, elem, node.input[0], lq_key) or ""
    return helper.make_node(MHA, [*node.input[:3], "", "", bias], [node.output[0]], name=node.name,
                            domain=MS_DOMAIN, num_heads=int(a[s.attr_num_heads]), scale=float(a[s.attr_scale]))
