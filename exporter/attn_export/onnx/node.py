"""The custom ONNX node of the attention core and its portable body.

Everything here follows the spec (csrc/attention_spec.h via attn_export.spec) and
docs/onnx_node.md:

* :func:`register_schema` registers an ``onnx.defs.OpSchema`` for the node in this process, so
  that torch's exporter (through onnxscript) accepts the custom-domain node;
* :func:`function_proto` (the generic body) and :func:`lean_function_proto` (one per
  :class:`BodyVariant`) build the model-local ``FunctionProto`` of the node's name whose body is
  standard ONNX ops, so ONNX Runtime (which inlines it) and any runtime without the TensorRT
  plugin run the model unchanged. Both bodies come from one definition, ``attn_export.onnx.body``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import onnx
from onnx import TensorProto, helper

from attn_export import spec as _spec
from attn_export.onnx import body as _body
from attn_export.ops.input_checks import FLOAT32_MAX


def _onnx_type_strings(elem_types) -> list:
    """ONNX type-constraint strings ("tensor(float)", ...) of TensorProto element types."""
    return [f"tensor({onnx.TensorProto.DataType.Name(t).lower()})" for t in elem_types]


def _default_attribute(a: _spec.Attribute) -> onnx.AttributeProto:
    return _body.default_attribute(a)


# What each attribute means, for the schema (names, types, required flags and defaults: the spec).
_ATTRIBUTE_DOCS = {
    "num_heads": "number of heads H",
    "scale": "multiplies q.k before the masks are added",
    "is_causal": "1: query i sees keys j <= i",
    "has_key_padding_mask": "0: the key_padding_mask input is a zero placeholder",
    "has_attn_mask": "0: the attn_mask input is a zero placeholder",
    "softcap": "> 0: the scaled score x becomes softcap * tanh(x / softcap) before the masks; 0: off",
    "causal_alignment": "with is_causal, 0: query i sees keys j <= i (top-left); 1: j <= i + Lk - Lq (bottom-right)",
    "kv_num_heads": "key/value heads Hkv dividing num_heads (grouped-query attention); 0: num_heads",
    "window": "with is_causal, > 0: query i sees only the last `window` keys up to its causal diagonal "
              "(sliding window); 0: no window",
    "has_past": "1: the cache form: inputs past_key/past_value [B, Hkv, P, D], outputs present_key/present_value "
                "[B, Hkv, P+S, D] (past then the new keys), attention over the present; 0: five inputs, one output",
    "alibi_slopes": "ALiBi: one float32 slope m[h] per query head (num_heads of them); adds "
                    "-m[h] * |i + Lk - Lq - j| with the masks (FlashAttention's alibi_slopes); empty: off",
    "plugin_namespace": "TensorRT plugin namespace",
    "plugin_version": "TensorRT plugin version",
}


def _attribute_doc(name: str) -> str:
    if name not in _ATTRIBUTE_DOCS:
        raise _spec.SpecError(f"the node attribute {name!r} of kAttributes (csrc/attention_spec.h) has no "
                              "description: add one to _ATTRIBUTE_DOCS in exporter/attn_export/onnx/node.py")
    return _ATTRIBUTE_DOCS[name]


def register_schema() -> None:
    """Registers the node's OpSchema with onnx (once per process; later calls do nothing)."""
    s = _spec.load()
    if onnx.defs.has(s.op_type, s.domain):
        return
    OpSchema = onnx.defs.OpSchema
    mask_inputs = {s.input_names[3], s.input_names[4]}
    # The plain form only: torch's exporter writes it (onnxscript takes the output count from
    # here); the cache form comes from a graph rewrite after it (passes/fold_past_custom.py) and its nodes
    # are checked through their model-local functions.
    inputs = [
        OpSchema.FormalParameter(name, "M" if name in mask_inputs else "T") for name in s.input_names
    ]
    # A list attribute (alibi_slopes) is optional without a default: onnxscript would otherwise
    # write the empty default on every node, which onnx-graphsurgeon and onnxslim cannot write
    # back (onnx.helper.make_attribute cannot type an empty list).
    attributes = [
        OpSchema.Attribute(a.name, OpSchema.AttrType(a.type), _attribute_doc(a.name),
                           required=a.required)
        if a.required or a.type_name == "FLOATS" else
        OpSchema.Attribute(a.name, _default_attribute(a), _attribute_doc(a.name))
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


# A node attribute's Python type, by its spec type.
_ATTRIBUTE_TYPES = {"INT": int, "FLOAT": float, "STRING": str, "FLOATS": lambda values: [float(x) for x in values]}


def node_attributes(num_heads: int, scale: float, is_causal: bool, has_key_padding_mask: bool,
                    has_attn_mask: bool, softcap: float = 0.0, causal_alignment: int = 0,
                    kv_num_heads: Optional[int] = None, window: int = 0, has_past: bool = False,
                    alibi_slopes: Optional[Sequence[float]] = None) -> dict:
    """The attributes every exported node carries, by their spec names; ``kv_num_heads`` None
    is num_heads (no grouping). Every attribute is written, also at its default: a body's
    attribute references then never rely on the function's defaults, which not every tool
    applies (onnx.inliner leaves such a Constant without a value). The one exception is
    ``alibi_slopes``, given only when there are slopes (None or empty: no ALiBi, and no lean body
    reads it): an empty list is what onnx.helper.make_attribute cannot type, so neither
    helper.make_node nor onnx-graphsurgeon and onnxslim could write it."""
    s = _spec.load()
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1; got {num_heads}")
    if kv_num_heads is not None and (kv_num_heads < 1 or num_heads % kv_num_heads):
        raise ValueError(f"kv_num_heads must divide num_heads={num_heads}; got {kv_num_heads}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    given = {
        s.attr_num_heads: num_heads,
        s.attr_scale: scale,
        s.attr_is_causal: bool(is_causal),
        s.attr_has_key_padding_mask: bool(has_key_padding_mask),
        s.attr_has_attn_mask: bool(has_attn_mask),
        s.attr_softcap: softcap,
        s.attr_causal_alignment: causal_alignment,
        s.attr_kv_num_heads: num_heads if kv_num_heads is None else kv_num_heads,
        s.attr_window: window,
        s.attr_has_past: bool(has_past),
        s.attr_alibi_slopes: list(alibi_slopes or ()),
        s.attr_plugin_namespace: s.plugin_namespace,
        s.attr_plugin_version: s.plugin_version,
    }
    refusals = [f"{name} must be an integer; got {value}" for name, value in given.items()
                if s.attribute[name].type_name == "INT" and not float(value).is_integer()]
    refusals += s.refusals(given)
    refusals += _alibi_refusals(given[s.attr_alibi_slopes], num_heads)
    if window and not is_causal:
        refusals.append(f"window > 0 needs is_causal (the window ends at the causal diagonal); got window={window}")
    if refusals:
        raise ValueError(refusals[0])
    if not given[s.attr_alibi_slopes]:
        del given[s.attr_alibi_slopes]  # no slopes: not written (the docstring says why)
    return {name: _ATTRIBUTE_TYPES[s.attribute[name].type_name](value) for name, value in given.items()}


def _alibi_refusals(slopes, num_heads: int) -> list:
    """Why the slopes cannot be the node's (none when empty: no ALiBi)."""
    if not slopes:
        return []
    if len(slopes) != num_heads:
        return [f"alibi_slopes must have one slope per query head (num_heads = {num_heads}); got {len(slopes)}"]
    return [f"alibi_slopes must be finite float32 numbers; got {x!r} for head {h}" for h, x in enumerate(slopes)
            if not math.isfinite(x) or abs(x) > FLOAT32_MAX][:1]


def is_attention_domain(domain: str) -> bool:
    """Whether a node or function of this domain is the FusedAttention node: the spec's domain
    (hand-built nodes, the exporter before the bodies are attached) or one of its per-variant
    domains ``<domain>.<variant>`` (docs/onnx_node.md, "The lean bodies")."""
    base = _spec.load().domain
    return domain == base or domain.startswith(base + ".")


def function_proto(opset: int, past: bool = False) -> onnx.FunctionProto:
    """The generic body: the model-local function of the spec's domain, right for every node of
    its form (``past``: the cache form's 7 inputs and 3 outputs) whatever its attributes and T
    (docs/onnx_node.md, "How ONNX Runtime runs it"), for a model of default-domain opset ``opset``."""
    plan = dataclasses.replace(_body.GENERIC, past=past)
    return _body.function_proto(plan, opset, _spec.load().domain)


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
    bottom_right: bool = False  # causal, aligned bottom-right (causal_alignment 1)
    grouped: bool = False  # grouped-query: kv_num_heads set and < num_heads
    windowed: bool = False  # causal with a sliding window (window > 0)
    past: bool = False  # the cache form (has_past): 7 inputs, 3 outputs
    alibi: bool = False  # ALiBi slopes (alibi_slopes not empty)

    @property
    def name(self) -> str:
        """``f32`` / ``cast`` followed by the parts of the work the body does, e.g. ``f32_causal_kpm``
        (``br``: bottom-right causal, ``win``: sliding window, ``gqa``: grouped-query, ``past``: the
        cache form, ``alibi``: ALiBi slopes)."""
        parts = ["f32" if self.float32 else "cast"]
        parts += [name for name, on in (("causal", self.is_causal), ("br", self.bottom_right), ("win", self.windowed),
                                        ("kpm", self.has_key_padding_mask), ("mask", self.has_attn_mask),
                                        ("softcap", self.softcap), ("alibi", self.alibi), ("gqa", self.grouped),
                                        ("past", self.past)) if on]
        return "_".join(parts)

    @property
    def domain(self) -> str:
        """The domain of the variant's nodes and function, e.g. ``attn_export.f32_kpm``."""
        return f"{_spec.load().domain}.{self.name}"

    @property
    def plan(self) -> _body.BodyPlan:
        """The lean body's plan: the variant's steps always, the others never."""
        return _body.BodyPlan(causal=_body.When.of(self.is_causal), softcap=_body.When.of(self.softcap),
                              key_padding_mask=self.has_key_padding_mask, attn_mask=self.has_attn_mask,
                              float32=self.float32, bottom_right=_body.When.of(self.bottom_right),
                              grouped=self.grouped, window=_body.When.of(self.windowed), past=self.past,
                              alibi=_body.When.of(self.alibi))

    @classmethod
    def of_node(cls, node: onnx.NodeProto, query_type: Optional[int]) -> "BodyVariant":
        """The variant of an exported node; ``query_type`` None (unknown) takes the casting body,
        which is right for every T."""
        s = _spec.load()
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        default = {a.name: a.default for a in s.attributes}

        def get(name):
            return attrs.get(name, default[name])

        causal = bool(get(s.attr_is_causal))
        kv_heads = int(get(s.attr_kv_num_heads))
        return cls(causal, bool(get(s.attr_has_key_padding_mask)), bool(get(s.attr_has_attn_mask)),
                   float(get(s.attr_softcap)) > 0, query_type == TensorProto.FLOAT,
                   bottom_right=causal and int(get(s.attr_causal_alignment)) == 1,
                   grouped=kv_heads not in (0, int(get(s.attr_num_heads))),
                   windowed=causal and int(get(s.attr_window)) > 0, past=bool(get(s.attr_has_past)),
                   alibi=len(get(s.attr_alibi_slopes)) > 0)


def lean_function_proto(opset: int, variant: BodyVariant) -> onnx.FunctionProto:
    """The function of the nodes of one :class:`BodyVariant`, in the domain ``variant.domain``:
    the result of :func:`function_proto` with only the work the variant needs (docs/onnx_node.md,
    "The lean bodies")."""
    return _body.function_proto(variant.plan, opset, variant.domain)
