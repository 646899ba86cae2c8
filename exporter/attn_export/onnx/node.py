"""The custom ONNX node of the attention core and its portable body.

Everything here follows the spec (csrc/attention_spec.h via attn_export.spec) and
docs/onnx_node.md:

* :func:`register_schema` registers an ``onnx.defs.OpSchema`` for the node in this process, so
  that torch's exporter (through onnxscript) accepts the custom-domain node;
* :func:`function_proto` builds the model-local ``FunctionProto`` of the same domain and name
  whose body is standard ONNX ops, so ONNX Runtime (which inlines it) and any runtime without
  the TensorRT plugin run the model unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import onnx
from onnx import TensorProto, helper

from attn_export import spec as _spec

def _onnx_type_strings(elem_types) -> list:
    """ONNX type-constraint strings ("tensor(float)", ...) of TensorProto element types."""
    return [f"tensor({onnx.TensorProto.DataType.Name(t).lower()})" for t in elem_types]


def _default_attribute(a: _spec.Attribute) -> onnx.AttributeProto:
    return helper.make_attribute(a.name, a.default)


# What each attribute means, for the schema (names, types, required flags and defaults: the spec).
_ATTRIBUTE_DOCS = {
    "num_heads": "number of heads H",
    "scale": "multiplies q.k before the masks are added",
    "is_causal": "1: query i sees keys j <= i",
    "has_key_padding_mask": "0: the key_padding_mask input is a zero placeholder",
    "has_attn_mask": "0: the attn_mask input is a zero placeholder",
    "softcap": "> 0: the scaled score x becomes softcap * tanh(x / softcap) before the masks; 0: off",
    "plugin_namespace": "TensorRT plugin namespace",
    "plugin_version": "TensorRT plugin version",
}


def register_schema() -> None:
    """Registers the node's OpSchema with onnx (once per process; later calls do nothing)."""
    s = _spec.load()
    if onnx.defs.has(s.op_type, s.domain):
        return
    OpSchema = onnx.defs.OpSchema
    mask_inputs = {s.input_names[3], s.input_names[4]}
    inputs = [
        OpSchema.FormalParameter(name, "M" if name in mask_inputs else "T") for name in s.input_names
    ]
    attributes = [
        OpSchema.Attribute(a.name, OpSchema.AttrType(a.type), _ATTRIBUTE_DOCS[a.name], required=True)
        if a.required else OpSchema.Attribute(a.name, _default_attribute(a), _ATTRIBUTE_DOCS[a.name])
        for a in s.attributes
    ]
    schema = OpSchema(
        s.op_type,
        s.domain,
        s.domain_version,
        "Fused scaled dot-product attention core (attn_export); see docs/onnx_node.md",
        inputs=inputs,
        outputs=[OpSchema.FormalParameter(name, "T") for name in s.output_names],
        type_constraints=[
            ("T", _onnx_type_strings(s.tensor_types), "query/key/value/output"),
            ("M", _onnx_type_strings([s.mask_type]), "additive masks"),
        ],
        attributes=attributes,
    )
    onnx.defs.register_schema(schema)


def node_attributes(num_heads: int, scale: float, is_causal: bool, has_key_padding_mask: bool,
                    has_attn_mask: bool, softcap: float = 0.0) -> dict:
    """The attributes every exported node carries, by their spec names."""
    s = _spec.load()
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1; got {num_heads}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off); got {softcap}")
    return {
        s.attr_num_heads: int(num_heads),
        s.attr_scale: float(scale),
        s.attr_is_causal: int(bool(is_causal)),
        s.attr_has_key_padding_mask: int(bool(has_key_padding_mask)),
        s.attr_has_attn_mask: int(bool(has_attn_mask)),
        s.attr_softcap: float(softcap),
        s.attr_plugin_namespace: s.plugin_namespace,
        s.attr_plugin_version: s.plugin_version,
    }


def _const(name, values, dtype=TensorProto.INT64, dims=None):
    dims = [len(values)] if dims is None else dims
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, dims, values))


def _attr_const(name, attr_name, kind):
    """A Constant whose value is the calling node's attribute ``attr_name`` (value_int / value_float)."""
    node = helper.make_node("Constant", [], [name])
    ref = onnx.AttributeProto()
    ref.name = kind
    ref.ref_attr_name = attr_name
    ref.type = onnx.AttributeProto.INT if kind == "value_int" else onnx.AttributeProto.FLOAT
    node.attribute.append(ref)
    return node


def _head_split_nodes(query: str, key: str, value: str, unread: tuple = ()) -> list:
    """The head split [B, L, H*D] -> q [B, H, Lq, D], kt [B, H, D, Lk], v [B, H, Lk, Dv]
    (Reshape to [0, 0, H, -1]: Reshape's 0 copies B and L). Each of ``unread`` (inputs the body
    has no use for) joins the split shape as the empty slice ``Shape(x, start=0, end=0)``."""
    n = helper.make_node
    empty = [f"{name}_no_dims" for name in unread]
    return [
        _attr_const("heads", _spec.load().attr_num_heads, "value_int"),
        _const("axis0", [0]),
        _const("zero2", [0, 0]),
        _const("minus1", [-1]),
        n("Unsqueeze", ["heads", "axis0"], ["heads1"]),
        *[n("Shape", [name], [out], start=0, end=0) for name, out in zip(unread, empty)],
        n("Concat", ["zero2", "heads1", "minus1", *empty], ["split_shape"], axis=0),
        n("Reshape", [query, "split_shape"], ["q4"]),
        n("Reshape", [key, "split_shape"], ["k4"]),
        n("Reshape", [value, "split_shape"], ["v4"]),
        n("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
        n("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
        n("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),
    ]


def _check_opset(opset: int) -> None:
    s = _spec.load()
    if opset < s.min_onnx_opset:
        raise ValueError(f"the {s.op_type} function body needs ONNX opset >= {s.min_onnx_opset}; got {opset}")


def is_attention_domain(domain: str) -> bool:
    """Whether a node or function of this domain is the FusedAttention node: the spec's domain
    (hand-built nodes, the exporter before the bodies are attached) or one of its per-variant
    domains ``<domain>.<variant>`` (docs/onnx_node.md, "The lean bodies")."""
    base = _spec.load().domain
    return domain == base or domain.startswith(base + ".")


def _make_function(nodes, opset: int, domain: Optional[str] = None) -> onnx.FunctionProto:
    s = _spec.load()
    function = helper.make_function(
        domain or s.domain,
        s.op_type,
        inputs=list(s.input_names),
        outputs=list(s.output_names),
        nodes=nodes,
        opset_imports=[helper.make_opsetid("", opset)],
        # The required attributes are the function's; the others (is_causal, softcap, ...) have
        # the spec's defaults. The has_* and plugin_* attributes are for the TensorRT plugin and
        # unused by the body.
        attributes=[a.name for a in s.attributes if a.required],
        attribute_protos=[_default_attribute(a) for a in s.attributes if not a.required],
        doc_string="attn_export fused attention core; see docs/onnx_node.md",
    )
    return function


def function_proto(opset: int) -> onnx.FunctionProto:
    """The node's model-local function for a model of default-domain opset ``opset``.

    The body, in float32 whatever T is (docs/onnx_node.md, "Function body"):

        q = Transpose(Reshape(query, [0, 0, H, -1]), [0, 2, 1, 3])        [B, H, Lq, D]
        k = Transpose(Reshape(key,   [0, 0, H, -1]), [0, 2, 3, 1])        [B, H, D, Lk]
        v = Transpose(Reshape(value, [0, 0, H, -1]), [0, 2, 1, 3])        [B, H, Lk, Dv]
        x = scale * q @ k
        c = Where(softcap > 0, cap * Tanh(x / cap), x)   with cap = Where(softcap > 0, softcap, 1)
        s = c + Unsqueeze(key_padding_mask, [1, 2]) + attn_mask + causal
        p = Where(IsInf(ReduceMax(s, -1), detect_positive=0), 0, Softmax(s, -1))
        output = CastLike(Reshape(Transpose(p @ v, [0, 2, 1, 3]), [0, 0, -1]), query)
    """
    s = _spec.load()
    _check_opset(opset)
    q_in, k_in, v_in, kpm_in, mask_in = s.input_names
    (out_name,) = s.output_names
    f32 = TensorProto.FLOAT

    const, attr_const = _const, _attr_const
    n = helper.make_node
    nodes = [
        n("Cast", [q_in], ["q32"], to=f32),
        n("Cast", [k_in], ["k32"], to=f32),
        n("Cast", [v_in], ["v32"], to=f32),
        *_head_split_nodes("q32", "k32", "v32"),
        # Scores and masks.
        attr_const("scale", s.attr_scale, "value_float"),
        n("MatMul", ["q", "kt"], ["qk"]),
        n("Mul", ["qk", "scale"], ["scaled"]),
        # Logit soft-capping, before the masks. One body serves every node, capped or not, so
        # the cap is selected at run time; the divisor is 1 when softcap is 0 (never x / 0).
        attr_const("softcap", s.attr_softcap, "value_float"),
        const("cap_zero", [0.0], f32, []),
        const("cap_one", [1.0], f32, []),
        n("Greater", ["softcap", "cap_zero"], ["cap_on"]),
        n("Where", ["cap_on", "softcap", "cap_one"], ["cap"]),
        n("Div", ["scaled", "cap"], ["scaled_over_cap"]),
        n("Tanh", ["scaled_over_cap"], ["tanh_scaled"]),
        n("Mul", ["tanh_scaled", "cap"], ["capped"]),
        n("Where", ["cap_on", "capped", "scaled"], ["scores_capped"]),
        const("axes12", [1, 2]),
        n("Unsqueeze", [kpm_in, "axes12"], ["kpm4"]),
        n("Add", ["scores_capped", "kpm4"], ["s1"]),
        n("Add", ["s1", mask_in], ["s2"]),
        # Causal: a [Lq, Lk] additive mask, -inf above the diagonal when is_causal is 1
        # (built unconditionally; multiplied away when is_causal is 0).
        n("Shape", [q_in], ["lq"], start=1, end=2),
        n("Shape", [k_in], ["lk"], start=1, end=2),
        n("Concat", ["lq", "lk"], ["qk_shape"], axis=0),
        n("ConstantOfShape", ["qk_shape"], ["ones"], value=helper.make_tensor("one", f32, [1], [1.0])),
        n("Trilu", ["ones"], ["visible"], upper=0),  # 1 where j <= i (top-left aligned)
        attr_const("causal_i", s.attr_is_causal, "value_int"),
        n("Cast", ["causal_i"], ["causal_f"], to=f32),
        const("one_f", [1.0], f32, []),
        n("Sub", ["one_f", "visible"], ["above"]),
        n("Mul", ["above", "causal_f"], ["blocked_f"]),
        n("Cast", ["blocked_f"], ["blocked"], to=TensorProto.BOOL),
        const("neg_inf", [-math.inf], f32, []),
        const("zero_f", [0.0], f32, []),
        n("Where", ["blocked", "neg_inf", "zero_f"], ["causal_add"]),
        n("Add", ["s2", "causal_add"], ["scores"]),
        # Softmax; a row whose scores are all -inf gives zeros, not NaN.
        const("last_axis", [-1]),
        n("ReduceMax", ["scores", "last_axis"], ["row_max"], keepdims=1),
        n("IsInf", ["row_max"], ["dead_row"], detect_positive=0, detect_negative=1),
        n("Softmax", ["scores"], ["probs_raw"], axis=-1),
        n("Where", ["dead_row", "zero_f", "probs_raw"], ["probs"]),
        # Weighted sum and head merge: [B, H, Lq, Dv] -> [B, Lq, H*Dv].
        n("MatMul", ["probs", "v"], ["ctx"]),
        n("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
        const("merge_shape", [0, 0, -1]),
        n("Reshape", ["ctx_t", "merge_shape"], ["ctx32"]),
        n("CastLike", ["ctx32", q_in], [out_name]),
    ]
    return _make_function(nodes, opset)


@dataclass(frozen=True)
class BodyVariant:
    """What one node's body has to compute, from its static attributes and its query type: the
    lean function of docs/onnx_node.md ("The lean bodies"). Nodes that share a variant share one
    function, told apart from the others by its domain, ``<spec domain>.<name>``: a function's
    identity is (domain, name[, overload]), and tools that ignore ``overload`` (onnx.reference,
    onnx-graphsurgeon) would run one body for every variant. TensorRT's parser ignores the
    domain, so every variant still maps to the one plugin."""

    is_causal: bool
    has_key_padding_mask: bool
    has_attn_mask: bool
    softcap: bool  # softcap > 0
    float32: bool  # T is float32: no casts

    @property
    def name(self) -> str:
        """``f32`` / ``cast`` followed by the parts of the work the body does, e.g. ``f32_causal_kpm``."""
        parts = ["f32" if self.float32 else "cast"]
        parts += [name for name, on in (("causal", self.is_causal), ("kpm", self.has_key_padding_mask),
                                        ("mask", self.has_attn_mask), ("softcap", self.softcap)) if on]
        return "_".join(parts)

    @property
    def domain(self) -> str:
        """The domain of the variant's nodes and function, e.g. ``attn_export.f32_kpm``."""
        return f"{_spec.load().domain}.{self.name}"

    @classmethod
    def of_node(cls, node: onnx.NodeProto, query_type: Optional[int]) -> "BodyVariant":
        """The variant of an exported node; ``query_type`` None (unknown) takes the casting body,
        which is right for every T."""
        s = _spec.load()
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        default = {a.name: a.default for a in s.attributes}

        def get(name):
            return attrs.get(name, default[name])

        return cls(bool(get(s.attr_is_causal)), bool(get(s.attr_has_key_padding_mask)),
                   bool(get(s.attr_has_attn_mask)), float(get(s.attr_softcap)) > 0,
                   query_type == TensorProto.FLOAT)


def lean_function_proto(opset: int, variant: BodyVariant) -> onnx.FunctionProto:
    """The node's function for the nodes of one :class:`BodyVariant` (in the domain
    ``variant.domain``): the same result as :func:`function_proto`, with only the work the
    variant needs (docs/onnx_node.md, "The lean bodies"):

        q = Transpose(Reshape(query, [0, 0, H, -1]), [0, 2, 1, 3]) * scale   (the scale on q, not on the scores)
        x = MatMul(q, Transpose(Reshape(key, [0, 0, H, -1]), [0, 2, 3, 1]))
        x = cap * Tanh(x / cap)                          softcap only
        bias = Unsqueeze(key_padding_mask, [1, 2])       key-padding mask only
             + attn_mask                                 attention mask only
             + Trilu(-inf[Lq, Lk], k=1, upper=1)         causal only
        p = Softmax(x + bias)
        ctx = MatMul(p, v)
        ctx = Where(IsInf(ReduceMax(bias, -1)), 0, ctx)  masks only: rows the masks empty are 0
        output = Reshape(Transpose(ctx, [0, 2, 1, 3]), [0, 0, -1])

    Causal masking alone never empties a row (query i always sees key 0), so the guard reads the
    bias, which is at most [B, H, Lq, Lk] and usually far smaller (a padding mask: [B, 1, 1, Lk]),
    and zeroes [.., Lq, Dv] outputs instead of [.., Lq, Lk] probabilities. T other than float32
    is cast to float32 and the output back (accumulation in float32, as the plugin).

    The body reads every input it declares: an absent mask (its zero placeholder) only for an
    empty slice of its shape, concatenated to the head-split shape (no change to it; ONNX Runtime
    folds it away with the other shape constants). Tools that drop the function inputs a body
    never reads (onnxslim) would otherwise leave the calling node with more inputs than the
    function declares."""
    s = _spec.load()
    _check_opset(opset)
    q_in, k_in, v_in, kpm_in, mask_in = s.input_names
    (out_name,) = s.output_names
    f32 = TensorProto.FLOAT
    n = helper.make_node
    nodes = []
    q, k, v = q_in, k_in, v_in
    if not variant.float32:
        nodes += [n("Cast", [q_in], ["q32"], to=f32), n("Cast", [k_in], ["k32"], to=f32),
                  n("Cast", [v_in], ["v32"], to=f32)]
        q, k, v = "q32", "k32", "v32"
    unread = tuple(name for name, used in ((kpm_in, variant.has_key_padding_mask), (mask_in, variant.has_attn_mask))
                   if not used)
    nodes += _head_split_nodes(q, k, v, unread) + [
        _attr_const("scale", s.attr_scale, "value_float"),
        n("Mul", ["q", "scale"], ["q_scaled"]),
        n("MatMul", ["q_scaled", "kt"], ["scaled"]),
    ]
    scores = "scaled"
    if variant.softcap:
        nodes += [
            _attr_const("softcap", s.attr_softcap, "value_float"),
            n("Div", ["scaled", "softcap"], ["scaled_over_cap"]),
            n("Tanh", ["scaled_over_cap"], ["tanh_scaled"]),
            n("Mul", ["tanh_scaled", "softcap"], ["capped"]),
        ]
        scores = "capped"
    terms = []
    if variant.has_key_padding_mask:
        nodes += [_const("axes12", [1, 2]), n("Unsqueeze", [kpm_in, "axes12"], ["kpm4"])]
        terms.append("kpm4")
    if variant.has_attn_mask:
        terms.append(mask_in)
    if variant.is_causal:
        # -inf strictly above the diagonal (j > i, top-left aligned), 0 elsewhere.
        nodes += [
            n("Shape", [q_in], ["lq"], start=1, end=2),
            n("Shape", [k_in], ["lk"], start=1, end=2),
            n("Concat", ["lq", "lk"], ["qk_shape"], axis=0),
            n("ConstantOfShape", ["qk_shape"], ["all_inf"],
              value=helper.make_tensor("neg_inf", f32, [1], [-math.inf])),
            _const("one", [1], dims=[]),
            n("Trilu", ["all_inf", "one"], ["causal_bias"], upper=1),
        ]
        terms.append("causal_bias")
    bias = terms[0] if terms else None
    for i, term in enumerate(terms[1:]):
        nodes.append(n("Add", [bias, term], [f"bias{i}"]))
        bias = f"bias{i}"
    if bias is not None:
        nodes.append(n("Add", [scores, bias], ["scores"]))
        scores = "scores"
    nodes += [
        n("Softmax", [scores], ["probs"], axis=-1),
        n("MatMul", ["probs", "v"], ["ctx_raw"]),
    ]
    ctx = "ctx_raw"
    if variant.has_key_padding_mask or variant.has_attn_mask:
        nodes += [
            _const("last_axis", [-1]),
            n("ReduceMax", [bias, "last_axis"], ["bias_max"], keepdims=1),
            n("IsInf", ["bias_max"], ["dead_row"], detect_positive=0, detect_negative=1),
            _const("zero_f", [0.0], f32, []),
            n("Where", ["dead_row", "zero_f", "ctx_raw"], ["ctx"]),
        ]
        ctx = "ctx"
    nodes += [
        n("Transpose", [ctx], ["ctx_t"], perm=[0, 2, 1, 3]),
        _const("merge_shape", [0, 0, -1]),
    ]
    if variant.float32:
        nodes.append(n("Reshape", ["ctx_t", "merge_shape"], [out_name]))
    else:
        nodes += [n("Reshape", ["ctx_t", "merge_shape"], ["ctx32"]), n("CastLike", ["ctx32", q_in], [out_name])]
    return _make_function(nodes, opset, domain=variant.domain)
