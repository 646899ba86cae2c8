"""The FusedAttention node's model-local function bodies, from one definition.

Every body the exporter writes is :func:`body_nodes` of a :class:`BodyPlan`: the generic body
(:data:`GENERIC`, right for every node, docs/onnx_node.md "How ONNX Runtime runs it") and the
lean body of each node variant (``attn_export.onnx.node.BodyVariant``, "The lean bodies") differ
only in their plan. The plan says, for each step a node attribute switches, whether the body
always does it, never does it, or selects it at run time from the calling node's attribute
(:class:`When`); the masks a body adds; and whether ``T`` is float32 (no casts).

The body, in the order it computes (each step one function of onnx/body_steps.py):

    q, k, v = Cast(query/key/value, float32)             not float32
    q, kt, v = split heads: Transpose(Reshape(x, [0, 0, H, -1]))     [B, H, Lq, D], [B, H, D, Lk], ...
      grouped (Hkv = kv_num_heads or H, G = H / Hkv; K/V never repeated, read once):
        q = Reshape(Transpose(Reshape(query, [0, 0, Hkv, G, -1]), [0, 2, 3, 1, 4]), [0, 0, G*Lq, -1])
                                                         [B, Hkv, G*Lq, D]: one MatMul per kv head
        kt, v = Transpose(Reshape(key/value, [0, 0, Hkv, -1]))           [B, Hkv, D, Lk], [B, Hkv, Lk, Dv]
    x = MatMul(q * scale, kt)                            (scale on q: Lq*D products, not Lq*Lk)
    x = softcap * Tanh(x / softcap)                      soft-capping
    bias = Unsqueeze(key_padding_mask, [1, 2]) + attn_mask + causal + alibi     the terms present
        causal = Trilu(-inf [Lq, Lk], k = 1 + (bottom-right ? Lk - Lq : 0), upper=1)
                 + Trilu(-inf [Lq, Lk], k - 1 - window, upper=0)    sliding window (window > 0)
        alibi = -Reshape(slopes, [H, 1, 1]) * Cast(Abs(Range(0, Lq)[:, None] + Lk - Lq - Range(0, Lk)))
                 [H, Lq, Lk]; slopes = Constant(alibi_slopes), padded with zeros to H heads where
                 the generic body reads an empty list (no ALiBi: adds -0)
        grouped: x viewed [B, Hkv, G, Lq, Lk] (Reshape), the padding mask [B, 1, 1, 1, Lk], the
        attn_mask's head axis split into (Hkv, G)
    ctx = MatMul(Softmax(x + bias), v)                   grouped: viewed [B, Hkv, G, Lq, Dv]
    ctx = Where(IsInf(ReduceMax(bias, -1)), 0, ctx)      rows the bias empties are 0 (a mask,
                                                         bottom-right causal with Lq > Lk, a window)
    output = CastLike(Reshape(Transpose(ctx, [0, 2, 1, 3]), [0, 0, -1]), query)
                                                         grouped: perm [0, 3, 1, 2, 4]

The cache form (``past``, has_past = 1) builds the presents first and reads K/V from them:

    present_key = Concat(past_key, Transpose(Reshape(key, [0, 0, Hkv, -1]), [0, 2, 1, 3]), axis 2)
                                                         [B, Hkv, P+S, D], in T (likewise value)
    kt = Transpose(Cast(present_key), [0, 1, 3, 2])      [B, Hkv, D, P+S]; ONNX Runtime fuses this
                                                         Transpose into the MatMul (FusedMatMul
                                                         transB=1): no pass over the cache
    v = Cast(present_value)                              [B, Hkv, P+S, Dv], as the MatMul reads it
    Lk = Shape(present_key)[2]                           for the causal mask

(only the S new tokens are transposed; the cache is read in its own head-major layout).

A new attribute is one step in body_steps.py (and, when lean bodies specialize on it, one field of the
plan and of ``BodyVariant``).
"""
from __future__ import annotations

from typing import List

import onnx
from onnx import helper

from attn_export import spec as _spec
from attn_export.onnx.body_plan import GENERIC, BodyPlan, When  # noqa: F401 - public here
from attn_export.onnx.body_steps import (  # noqa: F401 - _Body: the builder, as before
    BOOL,
    FLOAT,
    INT64,
    _Body,
    _bias,
    _Groups,
    _in_float32,
    _merge_heads,
    _past_heads,
    _soft_cap,
    _split_grouped_heads,
    _split_heads,
    _zero_dead_rows,
)


def body_nodes(plan: BodyPlan) -> List[onnx.NodeProto]:
    """The nodes of the body ``plan`` describes, reading the spec's input names and writing its
    output name."""
    s = _spec.load()
    b = _Body(plan.past)
    unread = [name for name, read in ((s.input_names[3], plan.key_padding_mask), (s.input_names[4], plan.attn_mask))
              if not read]
    groups = _Groups.of(b) if plan.grouped else None
    if plan.past:
        q, kt, v = _past_heads(b, plan.float32, unread, groups)
    else:
        query, key, value = _in_float32(b, plan.float32)
        q, kt, v = (_split_grouped_heads(b, query, key, value, unread, groups) if groups
                    else _split_heads(b, query, key, value, unread))
    scores = b.op("MatMul", b.op("Mul", q, b.attribute(s.attr_scale, FLOAT, out="scale"), out="q_scaled"), kt,
                  out="scaled")
    scores = flat = _soft_cap(b, scores, plan.softcap)
    bias = _bias(b, plan, groups)
    if bias is not None:
        scores = b.op("Add", groups.view(b, flat, "scores5") if groups else flat, bias, out="scores")
    probs = b.op("Softmax", scores, out="probs", axis=-1)
    if groups and bias is not None:
        probs = groups.flat(b, probs, "probs_flat")
    ctx = b.op("MatMul", probs, v, out="ctx_raw")
    if groups:
        ctx = groups.view(b, ctx, "ctx5")
    if plan.guards_dead_rows:
        ctx = _zero_dead_rows(b, ctx, bias)
    _merge_heads(b, ctx, plan.float32, grouped=groups is not None)
    return b.nodes


def default_attribute(a: _spec.Attribute) -> onnx.AttributeProto:
    """An optional attribute of the functions at its spec default. A list (alibi_slopes, default
    empty) defaults to [0.0] instead: tools that write attributes back through
    onnx.helper.make_attribute (onnx-graphsurgeon, onnxslim) cannot type an empty list, and the
    generic body pads the slopes with zeros to H heads, so [0.0] adds -0 as the empty list does."""
    if a.type == onnx.AttributeProto.FLOATS:
        return helper.make_attribute(a.name, [0.0])
    return helper.make_attribute(a.name, a.default)


def check_opset(opset: int) -> None:
    s = _spec.load()
    if opset < s.min_onnx_opset:
        raise ValueError(f"the {s.op_type} function body needs ONNX opset >= {s.min_onnx_opset}; got {opset}")


def function_proto(plan: BodyPlan, opset: int, domain: str) -> onnx.FunctionProto:
    """The model-local function ``domain.FusedAttention`` whose body is ``plan``'s, for a model
    of default-domain opset ``opset``: the spec's inputs, output and attributes."""
    s = _spec.load()
    check_opset(opset)
    return helper.make_function(
        domain,
        s.op_type,
        inputs=list(s.node_inputs(plan.past)),
        outputs=list(s.node_outputs(plan.past)),
        nodes=body_nodes(plan),
        opset_imports=[helper.make_opsetid("", opset)],
        # The required attributes are the function's; the others (is_causal, softcap, ...) have
        # the spec's defaults. The has_* and plugin_* attributes are for the TensorRT plugin and
        # unused by the body.
        attributes=[a.name for a in s.attributes if a.required],
        attribute_protos=[default_attribute(a) for a in s.attributes if not a.required],
        doc_string="attn_export fused attention core; see docs/onnx_node.md",
    )
