"""The steps of a FusedAttention function body, one function each (in the order onnx/body.py
lists them), written with :class:`_Body`, the body's node list."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import onnx
from onnx import TensorProto, helper

from attn_export import spec as _spec
from attn_export.onnx.body_plan import BodyPlan, When

FLOAT, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


class _Body:
    """A function body's node list, written one op at a time; every op names its output."""

    def __init__(self, past: bool = False):
        self.nodes: List[onnx.NodeProto] = []
        self._outputs: set = set()
        self._constants: Dict[tuple, str] = {}
        # Where Lk is read: the key input's axis 1, or the present's axis 2 (the cache form).
        self.key_length = (_spec.load().present_output_names[0], 2) if past else (_spec.load().input_names[1], 1)

    def op(self, op_type: str, *inputs: str, out: str, **attributes) -> str:
        if out in self._outputs:
            raise ValueError(f"the body already has a value named {out!r}")
        self._outputs.add(out)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attributes))
        return out

    def once(self, op_type: str, *inputs: str, out: str, **attributes) -> str:
        """op(), or ``out`` itself when an earlier once() made it: one node for a value that
        several steps read."""
        return out if out in self._outputs else self.op(op_type, *inputs, out=out, **attributes)

    def const(self, name: str, value) -> str:
        """A Constant: a list is 1-D, a number 0-D; ints are int64, floats float32. A value
        asked for again is the first one's output."""
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        dims = [len(values)] if isinstance(value, (list, tuple)) else []
        dtype = FLOAT if isinstance(values[0], float) else INT64
        key = (dtype, tuple(dims), tuple(values))
        if key not in self._constants:
            tensor = helper.make_tensor(name, dtype, dims, values)
            self._constants[key] = self.op("Constant", out=name, value=tensor)
        return self._constants[key]

    def attribute(self, name: str, dtype: int, out: str, list_of: bool = False) -> str:
        """A 0-D Constant whose value is the calling node's attribute ``name`` (INT64 or FLOAT), or
        with ``list_of`` a 1-D one from a FLOATS attribute."""
        kind, attr_type = ("value_int", onnx.AttributeProto.INT) if dtype == INT64 else (
            "value_float", onnx.AttributeProto.FLOAT)
        if list_of:
            kind, attr_type = "value_floats", onnx.AttributeProto.FLOATS
        self.op("Constant", out=out)
        ref = self.nodes[-1].attribute.add()
        ref.name, ref.ref_attr_name, ref.type = kind, name, attr_type
        return out


def _in_float32(b: _Body, float32: bool) -> Tuple[str, str, str]:
    """query, key and value in float32 (accumulation in float32 whatever T is, as the plugin)."""
    names = _spec.load().input_names[:3]
    if float32:
        return names
    return tuple(b.op("Cast", name, out=out, to=FLOAT) for name, out in zip(names, ("q32", "k32", "v32")))


def _split_heads(b: _Body, query: str, key: str, value: str, unread: List[str]) -> Tuple[str, str, str]:
    """[B, L, H*D] -> q [B, H, Lq, D], kt [B, H, D, Lk], v [B, H, Lk, Dv] (Reshape's 0 copies B
    and L). Each of ``unread`` (an input the body has no other use for) joins the split shape as
    the empty slice ``Shape(x, start=0, end=0)``: tools that drop the function inputs a body never
    reads (onnxslim) would otherwise leave the calling node with more inputs than the function."""
    heads = b.op("Unsqueeze", b.attribute(_spec.load().attr_num_heads, INT64, out="heads"), b.const("axis0", [0]),
                 out="heads1")
    empty = [b.op("Shape", name, out=f"{name}_no_dims", start=0, end=0) for name in unread]
    shape = b.op("Concat", b.const("zero2", [0, 0]), heads, b.const("minus1", [-1]), *empty, out="split_shape",
                 axis=0)
    q4, k4, v4 = (b.op("Reshape", x, shape, out=out) for x, out in ((query, "q4"), (key, "k4"), (value, "v4")))
    return (b.op("Transpose", q4, out="q", perm=[0, 2, 1, 3]), b.op("Transpose", k4, out="kt", perm=[0, 2, 3, 1]),
            b.op("Transpose", v4, out="v", perm=[0, 2, 1, 3]))


@dataclass(frozen=True)
class _Groups:
    """Grouped-query heads without repeating key/value: query head h = g * G + j (G = H / Hkv)
    is row j of key/value head g's group, so q is viewed as [B, Hkv, G*Lq, D] and one MatMul
    per key/value head serves its whole group (K and V are read once, never expanded). Scores
    and context are viewed [B, Hkv, G, Lq, .] (a Reshape, no copy) where the masks, which are
    per query, are added."""

    kv_heads: str  # [1]: Hkv (kv_num_heads, or num_heads when 0)
    group: str  # [1]: G = H / Hkv

    @classmethod
    def of(cls, b: _Body) -> "_Groups":
        s = _spec.load()
        heads = b.attribute(s.attr_num_heads, INT64, out="heads_q")
        kv_attr = b.attribute(s.attr_kv_num_heads, INT64, out="kv_heads_attr")
        kv = b.op("Where", b.op("Equal", kv_attr, b.const("zero_i", 0), out="kv_heads_unset"), heads, kv_attr,
                  out="kv_heads")
        axis0 = b.const("axis0", [0])
        return cls(b.op("Unsqueeze", kv, axis0, out="kv_heads1"),
                   b.op("Unsqueeze", b.op("Div", heads, kv, out="group_size"), axis0, out="group1"))

    def flat(self, b: _Body, x: str, out: str) -> str:
        """[B, Hkv, G, Lq, N] -> [B, Hkv, G*Lq, N]."""
        rows = b.once("Mul", self.group, _length(b, 0), out="group_rows")
        shape = b.once("Concat", b.const("zero2", [0, 0]), rows, b.const("minus1", [-1]), out="group_flat_shape",
                       axis=0)
        return b.op("Reshape", x, shape, out=out)

    def view(self, b: _Body, x: str, out: str) -> str:
        """[B, Hkv, G*Lq, N] -> [B, Hkv, G, Lq, N]."""
        shape = b.once("Concat", b.const("zero2", [0, 0]), self.group, _length(b, 0), b.const("minus1", [-1]),
                       out="group_view_shape", axis=0)
        return b.op("Reshape", x, shape, out=out)


def _split_grouped_heads(b: _Body, query: str, key: str, value: str, unread: List[str],
                         groups: _Groups) -> Tuple[str, str, str]:
    """q [B, Hkv, G*Lq, D] (query [B, Lq, Hkv*G*D] through [B, Hkv, G, Lq, D]), kt [B, Hkv, D, Lk],
    v [B, Hkv, Lk, Dv]; ``unread`` joins a shape as in :func:`_split_heads`."""
    zero2, minus1 = b.const("zero2", [0, 0]), b.const("minus1", [-1])
    empty = [b.op("Shape", name, out=f"{name}_no_dims", start=0, end=0) for name in unread]
    q_shape = b.op("Concat", zero2, groups.kv_heads, groups.group, minus1, *empty, out="q_split_shape", axis=0)
    q5 = b.op("Transpose", b.op("Reshape", query, q_shape, out="q5"), out="q5t", perm=[0, 2, 3, 1, 4])
    kv_shape = b.op("Concat", zero2, groups.kv_heads, minus1, out="kv_split_shape", axis=0)
    k4, v4 = (b.op("Reshape", x, kv_shape, out=out) for x, out in ((key, "k4"), (value, "v4")))
    return (groups.flat(b, q5, "q"), b.op("Transpose", k4, out="kt", perm=[0, 2, 3, 1]),
            b.op("Transpose", v4, out="v", perm=[0, 2, 1, 3]))


def _past_heads(b: _Body, float32: bool, unread: List[str], groups: Optional[_Groups]) -> Tuple[str, str, str]:
    """The cache form: writes present_key/present_value = Concat(past, new keys/values head-major)
    in T, and returns q (as :func:`_split_heads` / :func:`_split_grouped_heads`), kt [B, Hkv, D, P+S]
    and v [B, Hkv, P+S, Dv] read from the presents; ``unread`` joins the query's split shape."""
    s = _spec.load()
    query, key, value = s.input_names[:3]
    present_key, present_value = s.present_output_names
    kv_heads = groups.kv_heads if groups else b.op(
        "Unsqueeze", b.attribute(s.attr_num_heads, INT64, out="heads"), b.const("axis0", [0]), out="heads1")
    kv_shape = b.op("Concat", b.const("zero2", [0, 0]), kv_heads, b.const("minus1", [-1]), out="kv_split_shape", axis=0)
    for new, past, present in ((key, s.past_input_names[0], present_key), (value, s.past_input_names[1], present_value)):
        heads_first = b.op("Transpose", b.op("Reshape", new, kv_shape, out=f"{new}_new4"), out=f"{new}_new",
                           perm=[0, 2, 1, 3])
        b.op("Concat", past, heads_first, out=present, axis=2)
    k, v = ((present_key, present_value) if float32 else
            (b.op("Cast", present_key, out="k32", to=FLOAT), b.op("Cast", present_value, out="v32", to=FLOAT)))
    q32 = query if float32 else b.op("Cast", query, out="q32", to=FLOAT)
    empty = [b.op("Shape", name, out=f"{name}_no_dims", start=0, end=0) for name in unread]
    zero2, minus1 = b.const("zero2", [0, 0]), b.const("minus1", [-1])
    if groups:
        q_shape = b.op("Concat", zero2, groups.kv_heads, groups.group, minus1, *empty, out="q_split_shape", axis=0)
        q5 = b.op("Transpose", b.op("Reshape", q32, q_shape, out="q5"), out="q5t", perm=[0, 2, 3, 1, 4])
        q = groups.flat(b, q5, "q")
    else:
        q_shape = b.op("Concat", zero2, kv_heads, minus1, *empty, out="q_split_shape", axis=0)
        q = b.op("Transpose", b.op("Reshape", q32, q_shape, out="q4"), out="q", perm=[0, 2, 1, 3])
    return q, b.op("Transpose", k, out="kt", perm=[0, 1, 3, 2]), v


def _length(b: _Body, which: int) -> str:
    """[1]: Lq (``which`` 0, from query) or Lk (1, from key, or the present in the cache form),
    one Shape node for every reader."""
    s = _spec.load()
    if which == 0:
        return b.once("Shape", s.input_names[0], out="lq", start=1, end=2)
    name, axis = b.key_length
    return b.once("Shape", name, out="lk", start=axis, end=axis + 1)


def _grouped_attn_mask(b: _Body, groups: _Groups) -> str:
    """attn_mask [B|1, H|1, Lq|1, Lk|1] viewed [B|1, Hkv|1, G|1, Lq|1, Lk|1], as the grouped
    scores: a head axis H splits into (Hkv, G) (Min(H, G) = G), a broadcast 1 into (1, 1)."""
    mask = _spec.load().input_names[4]
    mask_heads = b.op("Shape", mask, out="mask_heads", start=1, end=2)
    mask_group = b.op("Min", mask_heads, groups.group, out="mask_group")
    shape = b.op("Concat", b.op("Shape", mask, out="mask_batch", start=0, end=1),
                 b.op("Div", mask_heads, mask_group, out="mask_kv_heads"), mask_group,
                 b.op("Shape", mask, out="mask_qk", start=2, end=4), out="mask_group_shape", axis=0)
    return b.op("Reshape", mask, shape, out="attn_mask5")


def _soft_cap(b: _Body, scores: str, when: When) -> str:
    """softcap * tanh(scores / softcap), before the masks (so a -inf mask still removes a key)."""
    if when is When.NEVER:
        return scores
    softcap = b.attribute(_spec.load().attr_softcap, FLOAT, out="softcap")
    if when is When.ALWAYS:
        return _capped(b, scores, softcap)
    on = b.op("Greater", softcap, b.const("zero_f", 0.0), out="cap_on")
    # Divided by 1 when the cap is off: the branch Where leaves out never computes x / 0.
    cap = b.op("Where", on, softcap, b.const("one_f", 1.0), out="cap")
    return b.op("Where", on, _capped(b, scores, cap), scores, out="scores_capped")


def _capped(b: _Body, scores: str, cap: str) -> str:
    over = b.op("Div", scores, cap, out="scaled_over_cap")
    return b.op("Mul", b.op("Tanh", over, out="tanh_scaled"), cap, out="capped")


def _bias(b: _Body, plan: BodyPlan, groups: Optional[_Groups]) -> Optional[str]:
    """The sum of the additive terms the plan has (None: no term, no Add at all), shaped for the
    scores: [B, H, Lq, Lk], or [B, Hkv, G, Lq, Lk] grouped (each term broadcast from its own
    smaller shape: a padding mask stays [B, 1, 1, (1,) Lk])."""
    s = _spec.load()
    terms = []
    if plan.key_padding_mask:
        axes = b.const("axes123", [1, 2, 3]) if groups else b.const("axes12", [1, 2])
        terms.append(b.op("Unsqueeze", s.input_names[3], axes, out="kpm4"))
    if plan.attn_mask:
        terms.append(_grouped_attn_mask(b, groups) if groups else s.input_names[4])
    if plan.causal is not When.NEVER:
        terms.append(_causal_bias(b, plan.causal, plan.bottom_right, plan.window))
    if plan.alibi is not When.NEVER:
        terms.append(_alibi_bias(b, plan.alibi, groups))
    bias = terms[0] if terms else None
    for i, term in enumerate(terms[1:]):
        bias = b.op("Add", bias, term, out=f"bias{i}")
    return bias


def _causal_bias(b: _Body, when: When, bottom_right: When, window: When = When.NEVER) -> str:
    """[Lq, Lk]: -inf strictly above the diagonal, 0 elsewhere: key j > query i (top-left) or
    j > i + Lk - Lq (bottom-right, from the run-time lengths); with a window, -inf also on and
    below the diagonal `window` keys back."""
    s = _spec.load()
    lq, lk = _length(b, 0), _length(b, 1)
    all_inf = b.op("ConstantOfShape", b.op("Concat", lq, lk, out="qk_shape", axis=0), out="all_inf",
                   value=helper.make_tensor("neg_inf", FLOAT, [1], [-math.inf]))
    # Trilu's k is a 0-D tensor in the operator's spec (ONNX Runtime also takes [1]; others need not).
    diagonal = _diagonal(b, lq, lk, bottom_right)
    causal = b.op("Trilu", all_inf, diagonal, out="causal_bias", upper=1)
    if window is not When.NEVER:
        causal = b.op("Add", causal, _window_bias(b, all_inf, diagonal, lq, lk, window), out="causal_window_bias")
    if when is When.ALWAYS:
        return causal
    on = b.op("Cast", b.attribute(s.attr_is_causal, INT64, out="causal_i"), out="causal_on", to=BOOL)
    return b.op("Where", on, causal, b.const("zero_f", 0.0), out="causal_add")


def _alibi_bias(b: _Body, when: When, groups: Optional[_Groups]) -> str:
    """ALiBi: -slopes[h] * |i + Lk - Lq - j|, [H, Lq, Lk] (grouped: [Hkv, G, Lq, Lk]), from the
    alibi_slopes attribute. BY_ATTRIBUTE (the generic body) pads the list with H zeros and keeps
    the first H: an empty list (no ALiBi) adds -0, which changes no score."""
    s = _spec.load()
    slopes = b.attribute(s.attr_alibi_slopes, FLOAT, out="alibi_slopes", list_of=True)
    heads = b.op("Unsqueeze", b.attribute(s.attr_num_heads, INT64, out="alibi_heads"), b.const("axis0", [0]),
                 out="alibi_heads1")
    if when is When.BY_ATTRIBUTE:
        zeros = b.op("ConstantOfShape", heads, out="alibi_zeros", value=helper.make_tensor("zero", FLOAT, [1], [0.0]))
        padded = b.op("Concat", slopes, zeros, out="alibi_padded", axis=0)
        slopes = b.op("Slice", padded, b.const("start0", [0]), heads, out="alibi_slopes_h")
    ones2 = b.const("ones2", [1, 1])
    shape = (b.op("Concat", groups.kv_heads, groups.group, ones2, out="alibi_shape", axis=0) if groups
             else b.op("Concat", heads, ones2, out="alibi_shape", axis=0))
    negated = b.op("Neg", b.op("Reshape", slopes, shape, out="alibi_slopes4"), out="alibi_neg_slopes")
    lq, lk = _length(b, 0), _length(b, 1)
    zero, one = b.const("zero_i", 0), b.const("one", 1)
    rows = b.op("Range", zero, b.op("Squeeze", lq, out="lq0"), one, out="alibi_rows")
    cols = b.op("Range", zero, b.op("Squeeze", lk, out="lk0"), one, out="alibi_cols")
    shifted = b.op("Add", rows, b.op("Sub", lk, lq, out="alibi_shift"), out="alibi_diagonal")
    distance = b.op("Abs", b.op("Sub", b.op("Unsqueeze", shifted, b.const("last1", [1]), out="alibi_diagonal2"),
                                b.op("Unsqueeze", cols, b.const("axis0", [0]), out="alibi_cols2"),
                                out="alibi_offset"), out="alibi_distance_i")
    return b.op("Mul", negated, b.op("Cast", distance, out="alibi_distance", to=FLOAT), out="alibi_bias")


def _diagonal(b: _Body, lq: str, lk: str, bottom_right: When) -> str:
    """Trilu's k, 0-D: the first masked diagonal, 1 (top-left) or 1 + Lk - Lq (bottom-right)."""
    one = b.const("one", 1)
    if bottom_right is When.NEVER:
        return one
    shift = b.op("Squeeze", b.op("Sub", lk, lq, out="lk_minus_lq1"), out="lk_minus_lq")
    if bottom_right is When.BY_ATTRIBUTE:
        alignment = b.attribute(_spec.load().attr_causal_alignment, INT64, out="alignment")
        shift = b.op("Mul", shift, alignment, out="alignment_shift")
    return b.op("Add", one, shift, out="causal_diagonal")


def _window_bias(b: _Body, all_inf: str, diagonal: str, lq: str, lk: str, when: When) -> str:
    """[Lq, Lk]: -inf where key j <= i + shift - window (before query i's window), 0 elsewhere:
    the lower triangle from Trilu's diagonal k = diagonal - 1 - window. Window 0 (no window, BY_ATTRIBUTE
    only) is taken as Lq + Lk, a diagonal below every row: nothing masked."""
    window = b.attribute(_spec.load().attr_window, INT64, out="window")
    if when is When.BY_ATTRIBUTE:
        none = b.op("Squeeze", b.op("Add", lq, lk, out="lq_plus_lk1"), out="lq_plus_lk")
        window = b.op("Where", b.op("Greater", window, b.const("zero_i", 0), out="window_on"), window, none,
                      out="window_or_all")
    first_kept = b.op("Sub", diagonal, window, out="window_diagonal1")
    return b.op("Trilu", all_inf, b.op("Sub", first_kept, b.const("one", 1), out="window_diagonal"),
                out="window_bias", upper=0)


def _zero_dead_rows(b: _Body, ctx: str, bias: str) -> str:
    """Rows that see no key output 0, not NaN. The guard reads the bias, not the scores: a row of
    -inf scores is exactly a row of -inf bias (the scaled, capped scores are finite), the bias is
    usually far smaller (a padding mask: [B, 1, 1, Lk]), and the Where zeroes [.., Lq, Dv]
    outputs instead of [.., Lq, Lk] probabilities."""
    row_max = b.op("ReduceMax", bias, b.const("last_axis", [-1]), out="bias_max", keepdims=1)
    dead = b.op("IsInf", row_max, out="dead_row", detect_positive=0, detect_negative=1)
    return b.op("Where", dead, b.const("zero_f", 0.0), ctx, out="ctx")


def _merge_heads(b: _Body, ctx: str, float32: bool, grouped: bool) -> None:
    """[B, H, Lq, Dv] (grouped: [B, Hkv, G, Lq, Dv]) -> the output [B, Lq, H*Dv], in T."""
    s = _spec.load()
    (output,) = s.output_names
    perm = [0, 3, 1, 2, 4] if grouped else [0, 2, 1, 3]
    merged = b.op("Reshape", b.op("Transpose", ctx, out="ctx_t", perm=perm),
                  b.const("merge_shape", [0, 0, -1]), out=output if float32 else "ctx32")
    if not float32:
        b.op("CastLike", merged, s.input_names[0], out=output)
