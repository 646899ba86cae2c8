"""standard_attention: the standard-``Attention`` flavor: each FusedAttention node of an
exported model becomes ONE ONNX ``Attention`` node (opset 23), which ONNX Runtime (1.23+) and
TensorRT's ONNX parser (10.14+, its native attention layer) implement themselves; no custom
domain, no plugin.

What the rewrite adds around the node (docs/onnx_node.md, "The standard flavor"):

* the masks as ONE additive mask of the node's type, with the query axis spelled out
  (``Expand`` to ``[.., Lq, Lk]``): ONNX Runtime 1.32 refuses a mask that broadcasts its query
  axis from 1 ("inconsistent q_sequence_length"), which is what a key-padding mask is;
* a causal layer without masks keeps ``is_causal=1`` (top-left aligned, as the op defines it
  also for ``Lq != Lk`` without a cache); bottom-right causal (``causal_alignment=1``), which
  opset 23 only has through its ``past_key`` input, and causal with masks join the mask, so that
* the guard sees every -inf: rows the mask empties give 0 (``Where`` on the output), where the
  op gives NaN or uniform weights; it reads the mask before the query axis is spelled out;
* mask and guard are built once per model for the layers that share them (``_SharedMasks``);
* bfloat16 runs the node in float32 between Casts (ONNX Runtime's CPU kernel has no bfloat16);
* grouped-query layers keep their key/value heads: ``kv_num_heads`` is the operator's own;
* ALiBi slopes (``alibi_slopes``), which opset 23 does not have, join the mask as the bias
  ``-m[h] * |i + Lk - Lq - j|`` ``[1, H, Lq, Lk]`` computed in the graph from the run-time lengths
  (the guard reads the mask before that finite term joins it);
* a cached export's Concat(past, new keys) is folded into the node's ``past_key``/``past_value``
  inputs and ``present_key``/``present_value`` outputs (editing.find_past).

A node the operator cannot express keeps the custom node (and its function), and the rewrite
says which and why: soft-capping together with a mask or causal masking, where opset 23 puts
the cap after the mask (a masked key comes back as -softcap) and runtimes disagree; a sliding
window (``window > 0``), which opset 23 does not have.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List

import onnx
from onnx import TensorProto, helper

from attn_export import spec as _spec
from attn_export.onnx.editing import (
    DEFAULT_DOMAINS, GraphIndex, NodeBuilder, PastFold, attention_nodes, drop_concats, find_past, remove_unused,
    replace_nodes, sequence_first, value_dims, value_types,
)
from attn_export.onnx.node import is_attention_domain
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome
from attn_export.onnx_options import STANDARD_MIN_OPSET as MIN_OPSET
from attn_export.onnx_options import check_standard_opset as check_opset  # noqa: F401 - public here


@dataclass
class StandardRewrite:
    converted: int
    kept: List[str]  # "node <name>: <reason>" for each node left custom


def _attrs(node: onnx.NodeProto) -> Dict[str, object]:
    s = _spec.load()
    values = {a.name: a.default for a in s.attributes}
    values.update({a.name: helper.get_attribute_value(a) for a in node.attribute})
    return values


def _expressed(s) -> set:
    """The node attributes the rewrite below carries over to the standard operator."""
    return {s.attr_num_heads, s.attr_scale, s.attr_is_causal, s.attr_has_key_padding_mask, s.attr_has_attn_mask,
            s.attr_softcap, s.attr_causal_alignment, s.attr_kv_num_heads, s.attr_window, s.attr_alibi_slopes,
            s.attr_plugin_namespace, s.attr_plugin_version}


def _bottom_right(a: Dict[str, object]) -> bool:
    """Causal masking aligned bottom-right (query i sees keys j <= i + Lk - Lq)."""
    s = _spec.load()
    return bool(a[s.attr_is_causal]) and int(a[s.attr_causal_alignment]) == 1


def why_not_standard(node: onnx.NodeProto) -> str | None:
    """Why the standard operator cannot compute this node, or None."""
    s = _spec.load()
    a = _attrs(node)
    # An attribute added to the spec since this rewrite was written keeps the custom node unless
    # it is at its default (what the node computed before the attribute existed).
    unknown = sorted(name for name in a if name not in _expressed(s)
                     and (name not in s.attribute or a[name] != s.attribute[name].default))
    if unknown:
        return f"attribute {', '.join(unknown)} has no counterpart in the standard Attention operator"
    if a[s.attr_is_causal] and int(a[s.attr_window]) > 0:
        return (f"sliding window (window={int(a[s.attr_window])}): opset 23 Attention has no window, and a "
                "materialized [Lq, Lk] mask would undo the compact mask")
    heads, kv_heads = int(a[s.attr_num_heads]), int(a[s.attr_kv_num_heads])
    if kv_heads < 0 or (kv_heads and heads % kv_heads):
        return f"kv_num_heads={kv_heads} does not divide num_heads={heads}"
    masked = a[s.attr_is_causal] or a[s.attr_has_key_padding_mask] or a[s.attr_has_attn_mask]
    if float(a[s.attr_softcap]) > 0 and (masked or len(a[s.attr_alibi_slopes])):
        return ("soft-capping with a mask, causal masking or ALiBi: opset 23 Attention caps after adding the mask "
                "(a masked key would come back), attn-export caps before")
    return None


class _SharedMasks:
    """The additive mask of the rewritten nodes and its dead-row flags, built once per model for
    the nodes that read the same masks at the same query (and, causal, key) length, as the
    graph's recorded shapes say (equal symbols are equal sizes): every layer of a padded encoder
    shares one ``[B, 1, Lq, Lk]`` mask instead of expanding and reducing its own. A node whose
    lengths the graph does not record gets its own."""

    def __init__(self, model: onnx.ModelProto):
        self.dims = value_dims(model)
        self.built: Dict[tuple, "_Mask"] = {}

    def axis(self, name: str, axis: int):
        dims = self.dims.get(name)
        return dims[axis] if dims and len(dims) > axis and dims[axis] not in (None, "") else None

    def get(self, b: "NodeBuilder", node: onnx.NodeProto, index: int, compute: int,
            key_length: List[tuple] | None = None) -> "_Mask | None":
        """``key_length``: the (value, axis) whose sizes add up to the keys' length, where it is
        not the key input's axis 1 (a folded cache: past and new keys' axis 2; the present is
        the Attention node's own output, not yet computed where the mask is)."""
        s = _spec.load()
        a = _attrs(node)
        causal, has_kpm, has_mask = bool(a[s.attr_is_causal]), bool(a[s.attr_has_key_padding_mask]), bool(a[s.attr_has_attn_mask])
        bottom_right = _bottom_right(a)
        slopes = tuple(a[s.attr_alibi_slopes])
        if not (has_kpm or has_mask or bottom_right or slopes):
            return None  # top-left causal alone never empties a row: is_causal on the node, no mask, no guard
        lq, lk = self.axis(node.input[0], 1), self.axis(node.input[1], 1) if causal or slopes else "any"
        key = ((node.input[3] if has_kpm else None, node.input[4] if has_mask else None, causal, bottom_right, lq, lk,
                compute, slopes)
               if lq is not None and lk is not None else ("node", index))
        if key not in self.built:
            # The dead-row flags [B|1, H|1, Lq|1, 1] keep a head axis only where attn_mask has one.
            per_head = has_mask and self.axis(node.input[4], 1) != 1
            self.built[key] = _build_mask(b, node, causal, has_kpm, has_mask, compute, per_head, bottom_right,
                                          key_length or [(node.input[1], 1)], slopes)
        return self.built[key]


@dataclass
class _Mask:
    mask: str  # the Attention node's additive mask, [B|1, H|1, Lq, Lk] of the computing type
    # the dead rows: [B|1, Lq|1, 1] (per_head False) or [B|1, H, Lq|1, 1]; None: no row can be
    # empty (the mask is ALiBi's finite bias alone)
    dead: "str | None"
    per_head: bool


def _build_mask(b: "NodeBuilder", node: onnx.NodeProto, causal: bool, has_kpm: bool, has_mask: bool, compute: int,
                per_head: bool, bottom_right: bool = False, key_length: List[tuple] | None = None,
                alibi_slopes: tuple = ()) -> _Mask:
    q, k, _, kpm, mask = node.input
    terms = []
    if has_kpm:
        terms.append(b.op("Unsqueeze", [kpm, b.const("axes12", [1, 2])], "kpm4"))
    if has_mask:
        terms.append(mask)
    lq = b.op("Shape", [q], "lq", start=1, end=2)
    lk = _key_length(b, key_length or [(k, 1)]) if causal or alibi_slopes else None
    if causal:  # joins the mask, so the guard below sees it (-inf strictly above the diagonal)
        causal_bias = _causal_bias(b, lq, lk, bottom_right)
        if not terms:  # the only term: [1, 1, Lq, Lk], the rank the guard's flags are read at
            causal_bias = b.op("Unsqueeze", [causal_bias, b.const("axes01", [0, 1])], "causal_bias4")
        terms.append(causal_bias)
    bias = _sum(b, terms, "bias")
    dead = None
    if bias is not None:
        # The guard reads the bias before its query axis is spelled out: a padding mask's max over
        # keys is one value per batch row, not one per (row, query).
        dead = b.op("IsInf", [b.op("ReduceMax", [bias, b.const("last_axis", [-1])], "bias_max", keepdims=1)],
                    "dead_row", detect_positive=0, detect_negative=1)
        if not per_head:  # [B|1, 1, Lq|1, 1] -> [B|1, Lq|1, 1]: broadcasts against the output [B, Lq, H*Dv]
            dead = b.op("Squeeze", [dead, b.const("head_axis", [1])], "dead_rows")
    if alibi_slopes:  # finite: after the guard, which it would not change
        bias = _sum(b, [bias, _alibi_bias(b, lq, lk, alibi_slopes)], "alibi_mask")
    if not causal and not alibi_slopes:  # the query axis spelled out: [.., 1, Lk] -> [.., Lq, Lk]
        target = b.op("Concat", [b.const("ones2", [1, 1]), lq, b.const("one1", [1])], "mask_shape", axis=0)
        bias = b.op("Expand", [bias, target], "mask_full")
    if compute != TensorProto.FLOAT:
        bias = b.op("Cast", [bias], "mask_t", to=compute)
    return _Mask(bias, dead, per_head)


def _sum(b: "NodeBuilder", terms: List[str | None], out: str) -> "str | None":
    """The sum of the terms that are there (None: none is)."""
    terms = [t for t in terms if t is not None]
    total = terms[0] if terms else None
    for i, term in enumerate(terms[1:]):
        total = b.op("Add", [total, term], f"{out}{i}")
    return total


def _key_length(b: "NodeBuilder", sizes: List[tuple]) -> str:
    """[1]: Lk, the sum of the (value, axis) sizes (a folded cache: past and new keys)."""
    parts = [b.op("Shape", [name], "lk" if len(sizes) == 1 else f"lk{i}", start=axis, end=axis + 1)
             for i, (name, axis) in enumerate(sizes)]
    return parts[0] if len(parts) == 1 else b.op("Add", parts, "lk")


def _causal_bias(b: "NodeBuilder", lq: str, lk: str, bottom_right: bool) -> str:
    """[Lq, Lk]: -inf strictly above the causal diagonal (moved right by Lk - Lq bottom-right)."""
    all_inf = b.op("ConstantOfShape", [b.op("Concat", [lq, lk], "qk_shape", axis=0)], "all_inf",
                   value=helper.make_tensor("neg_inf", TensorProto.FLOAT, [1], [-math.inf]))
    diagonal = b.const("one", [1], dims=[])
    if bottom_right:  # the diagonal moves right by Lk - Lq (0-D, as Trilu's k)
        shift = b.op("Squeeze", [b.op("Sub", [lk, lq], "lk_minus_lq1")], "lk_minus_lq")
        diagonal = b.op("Add", [diagonal, shift], "causal_diagonal")
    return b.op("Trilu", [all_inf, diagonal], "causal_bias", upper=1)


def _alibi_bias(b: "NodeBuilder", lq: str, lk: str, slopes: tuple) -> str:
    """[1, H, Lq, Lk]: -slopes[h] * |i + Lk - Lq - j| in float32 (the node's function body's ALiBi term)."""
    negated = b.const("alibi_neg_slopes", [-float(m) for m in slopes], TensorProto.FLOAT, [1, len(slopes), 1, 1])
    zero, one = b.const("alibi_zero", [0], dims=[]), b.const("alibi_one", [1], dims=[])
    rows = b.op("Range", [zero, b.op("Squeeze", [lq], "alibi_lq"), one], "alibi_rows")
    cols = b.op("Range", [zero, b.op("Squeeze", [lk], "alibi_lk"), one], "alibi_cols")
    diagonal = b.op("Add", [rows, b.op("Sub", [lk, lq], "alibi_shift")], "alibi_diagonal")
    offset = b.op("Sub", [b.op("Unsqueeze", [diagonal, b.const("alibi_axis1", [1])], "alibi_diagonal2"),
                          b.op("Unsqueeze", [cols, b.const("alibi_axis0", [0])], "alibi_cols2")], "alibi_offset")
    distance = b.op("Cast", [b.op("Abs", [offset], "alibi_distance_i")], "alibi_distance", to=TensorProto.FLOAT)
    return b.op("Mul", [negated, distance], "alibi_bias")


def _standard_nodes(node: onnx.NodeProto, index: int, query_type: int | None,
                    masks: _SharedMasks, fold: "PastFold | None" = None) -> List[onnx.NodeProto]:
    """The nodes replacing ``node``; with ``fold`` (a cache, editing.find_past) the Attention node
    also takes the past and writes the presents."""
    s = _spec.load()
    a = _attrs(node)
    heads = int(a[s.attr_num_heads])
    kv_heads = int(a[s.attr_kv_num_heads]) or heads
    q, k, v = node.input[:3]
    (out,) = node.output
    b = NodeBuilder(f"{node.name or 'FusedAttention'}_{index}/standard")
    f32 = TensorProto.FLOAT
    # The node's computing type: T itself, or float32 for bfloat16 (and for an unknown T).
    compute = query_type if query_type in (TensorProto.FLOAT, TensorProto.FLOAT16) else f32
    if compute != query_type:
        q, k, v = (b.op("Cast", [x], f"{what}_f32", to=f32) for x, what in ((q, "q"), (k, "k"), (v, "v")))
    mask = masks.get(b, node, index, compute, [(fold.past_key, 2), (fold.new_key, 2)] if fold else None)
    inputs, outputs = [q, k, v] + ([mask.mask] if mask else []), None
    if fold:
        k, v = sequence_first(b, fold.new_key, "k"), sequence_first(b, fold.new_value, "v")
        inputs = [q, k, v, mask.mask if mask else "", fold.past_key, fold.past_value]
        outputs = [b.name("attention"), fold.present_key, fold.present_value]
    y = b.op("Attention", inputs, "attention", outputs=outputs, q_num_heads=heads,
             kv_num_heads=kv_heads, scale=float(a[s.attr_scale]), is_causal=int(bool(a[s.attr_is_causal]) and not mask),
             softcap=float(a[s.attr_softcap]))
    if mask and mask.dead is not None:  # rows the mask empties give 0
        zero = b.const("zero", [0.0], compute, [])
        if mask.per_head:  # [B, Lq, H*Dv] -> [B, Lq, H, Dv]; the flags [B|1, H, Lq|1, 1] -> [B|1, Lq|1, H, 1]
            y4 = b.op("Reshape", [y, b.const("split", [0, 0, heads, -1])], "y4")
            dead_t = b.op("Transpose", [mask.dead], "dead_t", perm=[0, 2, 1, 3])
            y = b.op("Reshape", [b.op("Where", [dead_t, zero, y4], "guarded"), b.const("merge", [0, 0, -1])], "y")
        else:
            y = b.op("Where", [mask.dead, zero, y], "guarded")
    if compute != query_type:  # CastLike: also right where the graph does not record T
        b.op("CastLike", [y, node.input[0]], "out", outputs=[out])
    else:
        b.nodes[-1].output[0] = out  # y is the last node's output
    return b.nodes


def to_standard_attention(model: onnx.ModelProto) -> StandardRewrite:
    """Rewrites, in place, every FusedAttention node the standard operator can express (see the
    module doc); the model's default-domain opset must be >= 23. Unused placeholder masks are
    removed. Returns how many were converted and which were kept custom, with the reason."""
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if opset < MIN_OPSET:
        raise ValueError(f"the standard Attention operator needs opset >= {MIN_OPSET}; the model has {opset}")
    types = value_types(model)
    targets = {id(n): n for n in attention_nodes(model)}
    masks = _SharedMasks(model)
    graph_index = GraphIndex(model)
    kept, converted, nodes, folds = [], 0, [], []
    for position, node in enumerate(model.graph.node):
        if id(node) not in targets:
            nodes.append(node)
            continue
        reason = why_not_standard(node)
        if reason:
            kept.append(f"node {node.name or position}: {reason}")
            nodes.append(node)
            continue
        fold = _fold(graph_index, node, types.get(node.input[0]))
        folds += [fold] if fold else []
        nodes.extend(_standard_nodes(node, position, types.get(node.input[0]), masks, fold))
        converted += 1
    replace_nodes(model, drop_concats(nodes, folds))
    remove_unused(model)
    if not kept:  # no custom node left: no custom domain
        imports = [o for o in model.opset_import if not is_attention_domain(o.domain)]
        del model.opset_import[:]
        model.opset_import.extend(imports)
    return StandardRewrite(converted, kept)


def _fold(index: GraphIndex, node: onnx.NodeProto, query_type: int | None) -> "PastFold | None":
    """The cache to fold into the node: none for top-left causal masking (the operator aligns
    it bottom-right with a past) and for types the node runs in float32 between Casts (the
    presents would come out float32)."""
    a = _attrs(node)
    s = _spec.load()
    if query_type not in (TensorProto.FLOAT, TensorProto.FLOAT16):
        return None
    return find_past(index, node, top_left_causal=bool(a[s.attr_is_causal]) and not _bottom_right(a))


class StandardAttention(GraphPass):
    """The standard flavor's rewrite; the layers kept custom are the notes."""

    name = "standard_attention"
    flavors = ("standard",)

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        context.standard = to_standard_attention(model)
        return PassOutcome(context.standard.converted,
                           tuple(f"kept as the custom node: {line}" for line in context.standard.kept))
