"""The fused attention node's names, attribute types and defaults, accepted element types and the
torch operators' names, read from the one spec, ``csrc/attention_spec.h``.

The C++ header is the single source of truth (the TensorRT plugin includes it); this module
parses its ``inline constexpr`` constants (scalars, strings spelled as adjacent literals, arrays
and arrays of plain structs) with regular expressions, so the exporter can never drift from the
plugin. The operators' schema strings (``torch_schemas``) are parsed further, with torch's own
parser, by ops/signatures.py. tests/test_spec.py compiles the header and checks both agree, and that
exported models carry exactly these names. See docs/onnx_node.md.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

_HEADER = "attention_spec.h"

_TYPE = r"(?P<type>const\s+char\s*\*|int|bool|double|[A-Z]\w*)"
_NUMBER = r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"
# A string may be spelled as adjacent literals ("a" "b" is "ab"), as C++ joins them.
_STRING = r'(?:"[^"]*"\s*)+'
_VALUE = rf"{_STRING}|{_NUMBER}|true|false|k\w+"
_SCALAR = re.compile(
    rf"inline\s+constexpr\s+{_TYPE}\s+(?P<name>k\w+)\s*=\s*(?P<value>{_VALUE})\s*;"
)
# An array of scalars, or of structs: `T kName[N] = {a, b}` / `S kName[N] = {{a, b}, {c, d}}`.
_ARRAY = re.compile(
    rf"inline\s+constexpr\s+{_TYPE}\s+(?P<name>k\w+)\s*\[[^\]]*\]\s*=\s*\{{(?P<body>(?:[^{{}}]|\{{[^{{}}]*\}})*)\}}\s*;"
)
_STRUCT = re.compile(r"struct\s+(?P<name>\w+)\s*\{(?P<body>[^{}]*)\}\s*;")
_ENTRY = re.compile(r"\{([^{}]*)\}")

# ONNX AttributeProto.AttributeType -> the attribute type's name, and the TensorRT
# PluginFieldType the ONNX parser hands the plugin creator for it (INT and FLOAT narrowed).
_ATTR_TYPE_NAMES = {1: "FLOAT", 2: "INT", 3: "STRING", 6: "FLOATS"}
_PLUGIN_FIELD_TYPES = {"FLOAT": "FLOAT32", "INT": "INT32", "STRING": "CHAR", "FLOATS": "FLOAT32"}


class SpecError(RuntimeError):
    """The spec header is missing or does not define what the exporter needs."""


def header_path() -> Path:
    """The header is package data (in a checkout, a link to csrc/attention_spec.h)."""
    path = Path(__file__).parent / _HEADER
    if not path.is_file():
        raise SpecError(f"{_HEADER} is missing from the package at {path.parent}; reinstall attn-export")
    return path


def _literal(text: str, values: Dict[str, object]):
    """A C++ literal, or the name of a constant defined earlier in the header."""
    text = text.strip()
    if text.startswith('"'):
        return "".join(re.findall(r'"([^"]*)"', text))
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"k\w+", text):
        if text not in values:
            raise SpecError(f"{_HEADER}: {text} is used before it is defined")
        return values[text]
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return float(text)


def _members(struct_body: str) -> Tuple[str, ...]:
    """The member names of a plain struct, in declaration order."""
    return tuple(re.findall(r"(\w+)\s*;", struct_body))


def parse_header(text: str) -> Dict[str, object]:
    """Every ``inline constexpr`` scalar and array in the header: name -> str | int | bool |
    tuple; an array of structs becomes a tuple of dicts keyed by the struct's member names.
    A constant may name one defined before it."""
    text = re.sub(r"//[^\n]*", "", text)  # comments may quote names; only code counts
    structs = {m["name"]: _members(m["body"]) for m in _STRUCT.finditer(text)}
    values: Dict[str, object] = {}
    matches = sorted([*_SCALAR.finditer(text), *_ARRAY.finditer(text)], key=lambda m: m.start())
    for m in matches:
        if "body" not in m.groupdict():
            values[m["name"]] = _literal(m["value"], values)
        elif m["type"] in structs:
            members = structs[m["type"]]
            entries = []
            for entry in _ENTRY.findall(m["body"]):
                parts = [_literal(part, values) for part in entry.split(",") if part.strip()]
                if len(parts) != len(members):
                    raise SpecError(f"{_HEADER}: an entry of {m['name']} has {len(parts)} values for {members}")
                entries.append(dict(zip(members, parts)))
            values[m["name"]] = tuple(entries)
        else:
            values[m["name"]] = tuple(_literal(part, values) for part in m["body"].split(",") if part.strip())
    return values


@dataclass(frozen=True)
class Attribute:
    """One attribute of the node (kAttributes)."""

    name: str
    type: int  # ONNX AttributeProto.AttributeType: 1 FLOAT, 2 INT, 3 STRING, 6 FLOATS
    required: bool
    default: Union[int, float, str, Tuple[float, ...], None]  # None when required; FLOATS: ()

    @property
    def type_name(self) -> str:
        """"INT", "FLOAT", "STRING" or "FLOATS"."""
        return _ATTR_TYPE_NAMES[self.type]

    @property
    def plugin_field_type(self) -> str:
        """The TensorRT PluginFieldType name the ONNX parser gives this attribute's field:
        "INT32", "FLOAT32" or "CHAR"."""
        return _PLUGIN_FIELD_TYPES[self.type_name]


@dataclass(frozen=True)
class AttributeRange:
    """The values a restricted attribute may take (kAttributeRanges): finite, >= min and <= max
    (max None: no upper bound), with a short phrase of what they mean."""

    name: str
    min: float
    max: Optional[float]
    meaning: str

    @property
    def rule(self) -> str:
        """What the values must be, as the refusal words it (the C++ range_words)."""
        if self.max is None:
            return f"finite and >= {self.min:g} ({self.meaning})"
        joint = "or" if self.max == self.min + 1 else "to"
        return f"{self.min:g} {joint} {self.max:g} ({self.meaning})"

    def admits(self, value) -> bool:
        value = float(value)
        return math.isfinite(value) and value >= self.min and (self.max is None or value <= self.max)

    def refusal(self, value) -> str:
        """"<name> must be <rule>; got <value>", the value printed as C++'s ostream prints its
        type (:g for a double: -2, nan, 1e-30)."""
        shown = f"{value:g}" if isinstance(value, float) else f"{value}"
        return f"{self.name} must be {self.rule}; got {shown}"


@dataclass(frozen=True)
class AttentionSpec:
    domain: str
    domain_version: int
    op_type: str
    plugin_name: str
    plugin_version: str
    plugin_namespace: str
    attr_num_heads: str
    attr_scale: str
    attr_is_causal: str
    attr_has_key_padding_mask: str
    attr_has_attn_mask: str
    attr_softcap: str
    attr_causal_alignment: str
    attr_kv_num_heads: str
    attr_window: str
    attr_has_past: str
    attr_alibi_slopes: str
    attr_plugin_namespace: str
    attr_plugin_version: str
    attributes: Tuple[Attribute, ...]
    attribute_ranges: Tuple[AttributeRange, ...]  # the restricted attributes' values
    num_plugin_fields: int
    input_names: Tuple[str, ...]
    output_names: Tuple[str, ...]
    input_ranks: Tuple[int, ...]
    output_rank: int
    # The cache form (has_past = 1): inputs 5, 6 and outputs 1, 2 after the ones above, rank 4.
    past_input_names: Tuple[str, ...]
    present_output_names: Tuple[str, ...]
    cache_rank: int
    tensor_types: Tuple[int, ...]  # T: ONNX TensorProto.DataType values
    tensor_type_names: Tuple[str, ...]  # "float32", "float16", "bfloat16"
    mask_type: int  # M: the ONNX TensorProto.DataType of the masks
    torch_namespace: str
    torch_op_attention: str
    torch_op_attention_forward: str
    torch_op_attention_backward: str
    torch_op_multi_head_attention: str
    torch_op_multi_head_attention_forward: str
    torch_op_multi_head_attention_backward: str
    # Each operator's signature, "(Tensor query, ...) -> Tensor" (kSchema*), in torch_op_* order.
    torch_schema_attention: str
    torch_schema_attention_forward: str
    torch_schema_attention_backward: str
    torch_schema_multi_head_attention: str
    torch_schema_multi_head_attention_forward: str
    torch_schema_multi_head_attention_backward: str
    min_onnx_opset: int

    def node_inputs(self, has_past: bool = False) -> Tuple[str, ...]:
        """The node's input names: 5, or 7 in the cache form."""
        return self.input_names + (self.past_input_names if has_past else ())

    def node_outputs(self, has_past: bool = False) -> Tuple[str, ...]:
        """The node's output names: 1, or 3 in the cache form."""
        return self.output_names + (self.present_output_names if has_past else ())

    @property
    def attribute_names(self) -> Tuple[str, ...]:
        return tuple(a.name for a in self.attributes)

    @property
    def attribute(self) -> Dict[str, Attribute]:
        """The attributes by name."""
        return {a.name: a for a in self.attributes}

    def refusals(self, values: Dict[str, object]) -> Tuple[str, ...]:
        """For each value (by attribute name) outside its attribute's range (kAttributeRanges):
        why it is refused. Names without a range, and values in range, give nothing."""
        ranges = {r.name: r for r in self.attribute_ranges}
        return tuple(ranges[name].refusal(value) for name, value in values.items()
                     if name in ranges and not ranges[name].admits(value))

    @property
    def plugin_fields(self) -> Tuple[Attribute, ...]:
        """The attributes that are the TensorRT plugin's fields, in the plugin's order (all but
        plugin_namespace / plugin_version, which the ONNX parser reads itself)."""
        return self.attributes[: self.num_plugin_fields]

    @property
    def tensor_type_map(self) -> Dict[int, str]:
        """ONNX element type -> name, for the element types T may be."""
        return dict(zip(self.tensor_types, self.tensor_type_names))

    @property
    def mask_type_name(self) -> str:
        return self.tensor_type_map[self.mask_type]

    @property
    def torch_schemas(self) -> Dict[str, str]:
        """Each operator's qualified name -> its whole schema, "attn_export::attention(...) -> Tensor",
        as csrc/ops/attention.cpp registers it (attn_export/signatures.py parses them)."""
        return {getattr(self, f"torch_op_{op}"): getattr(self, f"torch_op_{op}") + getattr(self, f"torch_schema_{op}")
                for op in _OPERATORS}


_FIELDS = {
    "domain": "kOnnxDomain",
    "domain_version": "kOnnxDomainVersion",
    "op_type": "kOpType",
    "plugin_name": "kPluginName",
    "plugin_version": "kPluginVersion",
    "plugin_namespace": "kPluginNamespace",
    "attr_num_heads": "kAttrNumHeads",
    "attr_scale": "kAttrScale",
    "attr_is_causal": "kAttrIsCausal",
    "attr_has_key_padding_mask": "kAttrHasKeyPaddingMask",
    "attr_has_attn_mask": "kAttrHasAttnMask",
    "attr_softcap": "kAttrSoftcap",
    "attr_causal_alignment": "kAttrCausalAlignment",
    "attr_kv_num_heads": "kAttrKvNumHeads",
    "attr_window": "kAttrWindow",
    "attr_has_past": "kAttrHasPast",
    "attr_alibi_slopes": "kAttrAlibiSlopes",
    "attr_plugin_namespace": "kAttrPluginNamespace",
    "attr_plugin_version": "kAttrPluginVersion",
    "attributes": "kAttributes",
    "attribute_ranges": "kAttributeRanges",
    "num_plugin_fields": "kNumPluginFields",
    "input_names": "kInputNames",
    "output_names": "kOutputNames",
    "input_ranks": "kInputRanks",
    "output_rank": "kOutputRank",
    "past_input_names": "kPastInputNames",
    "present_output_names": "kPresentOutputNames",
    "cache_rank": "kCacheRank",
    "tensor_types": "kTensorTypes",
    "tensor_type_names": "kTensorTypeNames",
    "mask_type": "kMaskType",
    "torch_namespace": "kTorchNamespace",
    "torch_op_attention": "kOpAttention",
    "torch_op_attention_forward": "kOpAttentionForward",
    "torch_op_attention_backward": "kOpAttentionBackward",
    "torch_op_multi_head_attention": "kOpMultiHeadAttention",
    "torch_op_multi_head_attention_forward": "kOpMultiHeadAttentionForward",
    "torch_op_multi_head_attention_backward": "kOpMultiHeadAttentionBackward",
    "torch_schema_attention": "kSchemaAttention",
    "torch_schema_attention_forward": "kSchemaAttentionForward",
    "torch_schema_attention_backward": "kSchemaAttentionBackward",
    "torch_schema_multi_head_attention": "kSchemaMultiHeadAttention",
    "torch_schema_multi_head_attention_forward": "kSchemaMultiHeadAttentionForward",
    "torch_schema_multi_head_attention_backward": "kSchemaMultiHeadAttentionBackward",
    "min_onnx_opset": "kMinOnnxOpset",
}
# The operators, as the suffixes of their torch_op_* / torch_schema_* fields.
_OPERATORS = ("attention", "attention_forward", "attention_backward", "multi_head_attention",
              "multi_head_attention_forward", "multi_head_attention_backward")


def _attribute(entry: Dict[str, object]) -> Attribute:
    if entry["type"] not in _ATTR_TYPE_NAMES:
        raise SpecError(f"{_HEADER}: attribute {entry['name']!r} has an unknown type {entry['type']}")
    defaults = {1: float(entry["default_float"]), 2: entry["default_int"], 3: entry["default_string"], 6: ()}
    default = None if entry["required"] else defaults[entry["type"]]
    return Attribute(entry["name"], entry["type"], entry["required"], default)


def _attribute_range(entry: Dict[str, object], attributes: Dict[str, Attribute]) -> AttributeRange:
    if entry["name"] not in attributes:
        raise SpecError(f"{_HEADER}: kAttributeRanges names {entry['name']!r}, which is not in kAttributes")
    upper = float(entry["max"]) if entry["bounded_above"] else None
    return AttributeRange(entry["name"], float(entry["min"]), upper, entry["meaning"])


def spec_from_header(text: str) -> AttentionSpec:
    values = parse_header(text)
    missing = [const for const in _FIELDS.values() if const not in values]
    if missing:
        raise SpecError(f"{_HEADER} does not define {', '.join(missing)}")
    fields = {field: values[const] for field, const in _FIELDS.items()}
    fields["attributes"] = tuple(_attribute(entry) for entry in fields["attributes"])
    by_name = {a.name: a for a in fields["attributes"]}
    fields["attribute_ranges"] = tuple(_attribute_range(entry, by_name) for entry in fields["attribute_ranges"])
    spec = AttentionSpec(**fields)
    positions = [values.get(f"kInput{''.join(p.title() for p in n.split('_'))}") for n in spec.input_names]
    if positions != list(range(len(spec.input_names))) or values.get("kNumInputs") != len(spec.input_names):
        raise SpecError(f"{_HEADER}: kInput* positions {positions} disagree with kInputNames {spec.input_names}")
    cache = ([values.get(f"kInput{''.join(p.title() for p in n.split('_'))}") for n in spec.past_input_names],
             [values.get(f"kOutput{''.join(p.title() for p in n.split('_'))}") for n in spec.present_output_names])
    inputs, outputs = len(spec.input_names), len(spec.output_names)
    if (cache != ([inputs, inputs + 1], [outputs, outputs + 1]) or values.get("kNumPastInputs") != inputs + 2
            or values.get("kNumPastOutputs") != outputs + 2):
        raise SpecError(f"{_HEADER}: the cache form's positions {cache} must follow the plain form's "
                        f"{inputs} inputs and {outputs} output(s)")
    if spec.op_type != spec.plugin_name:
        raise SpecError(f"{_HEADER}: kOpType {spec.op_type!r} must equal kPluginName {spec.plugin_name!r}")
    named = {values[k] for k in values if k.startswith("kAttr") and isinstance(values[k], str)}
    if set(spec.attribute_names) != named or values.get("kNumAttributes") != len(spec.attributes):
        raise SpecError(f"{_HEADER}: kAttributes {spec.attribute_names} disagree with the kAttr* names {sorted(named)}")
    tail = [a.name for a in spec.attributes[spec.num_plugin_fields:]]
    if tail != [spec.attr_plugin_namespace, spec.attr_plugin_version]:
        raise SpecError(f"{_HEADER}: the attributes after the plugin's fields must be plugin_namespace and "
                        f"plugin_version; got {tail}")
    if len(spec.tensor_types) != len(spec.tensor_type_names) or spec.mask_type not in spec.tensor_types:
        raise SpecError(f"{_HEADER}: kTensorTypes / kTensorTypeNames / kMaskType disagree")
    ops = [v for k, v in fields.items() if k.startswith("torch_op_")]
    if any(not op.startswith(spec.torch_namespace + "::") for op in ops):
        raise SpecError(f"{_HEADER}: every kOp* must be in the {spec.torch_namespace}:: namespace; got {ops}")
    signatures = [v for k, v in fields.items() if k.startswith("torch_schema_")]
    if any(not (sig.startswith("(") and ") -> " in sig) for sig in signatures):
        raise SpecError(f"{_HEADER}: every kSchema* must be a signature \"(arguments) -> results\"; got {signatures}")
    return spec


@functools.lru_cache(maxsize=None)
def load() -> AttentionSpec:
    """The spec of the installed package (parsed once)."""
    return spec_from_header(header_path().read_text())
