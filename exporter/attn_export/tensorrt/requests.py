"""What the model's FusedAttention nodes ask TensorRT's parser for: the plugin's name, version
and namespace, the fields the creator receives, and the element types it must support."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import onnx

from attn_export import spec as _spec
from attn_export.tensorrt.runtime import PluginError

# The element types the plugin takes, from the spec (csrc/attention_spec.h): T and the masks' M.
SUPPORTED_ONNX_TYPES = _spec.load().tensor_type_map
MASK_ONNX_TYPE = _spec.load().mask_type
# What TensorRT's ONNX parser assumes for a node without a plugin_version attribute (the node's
# own default is the spec's current version; the exporter writes the attribute on every node).
PARSER_DEFAULT_PLUGIN_VERSION = "1"


@dataclass
class PluginRequest:
    """The plugin one or more FusedAttention nodes ask TensorRT's parser for."""

    name: str
    version: str
    namespace: str
    nodes: List[str] = field(default_factory=list)
    types: Dict[str, str] = field(default_factory=dict)  # node -> element type of its query

    def identity(self) -> str:
        return f"{self.name} version {self.version!r} namespace {self.namespace!r}"


def expected_fields() -> List[Tuple[str, str]]:
    """(name, PluginFieldType name) of every field the nodes hand the plugin creator: the ONNX
    node's attributes except plugin_version/plugin_namespace, INT -> INT32, FLOAT and FLOATS -> FLOAT32
    (the parser's narrowing; alibi_slopes is a FLOAT32 field of length H). tests/trt/test_tensorrt_plugin.py holds the C++ field table to the same list."""
    return [(f.name, f.plugin_field_type) for f in _spec.load().plugin_fields]


# plugin_field_collection's keywords beside num_heads and scale, and their defaults: the node's
# optional attributes (csrc/attention_spec.h), each a mirror of the operator's argument.
_OPTIONAL_FIELDS = {"is_causal": False, "has_key_padding_mask": False, "has_attn_mask": False, "softcap": 0.0,
                    "causal_alignment": 0, "kv_num_heads": 0, "window": 0, "has_past": False, "alibi_slopes": ()}


def plugin_field_collection(trt, *, num_heads: int, scale: float, **attributes):
    """The fields for ``creator.create_plugin`` when a network is built by hand (e.g. by the
    torch2trt converter): the spec's names and the types of :func:`expected_fields`.
    ``attributes``: the optional ones by name (``is_causal=True``, ``softcap=50.0``,
    ``alibi_slopes=[...]`` with one slope per query head; see ``_OPTIONAL_FIELDS`` for the names and
    defaults). Without slopes the alibi_slopes field is left out (ALiBi off), as on a node without them."""
    import numpy as np

    unknown = sorted(set(attributes) - set(_OPTIONAL_FIELDS))
    if unknown:
        raise TypeError(f"plugin_field_collection() got unexpected keyword argument(s) {', '.join(unknown)} "
                        f"(its attributes: {', '.join(_OPTIONAL_FIELDS)})")
    a = {**_OPTIONAL_FIELDS, **attributes}
    s = _spec.load()
    values = {s.attr_num_heads: num_heads, s.attr_scale: scale, s.attr_is_causal: int(a["is_causal"]),
              s.attr_has_key_padding_mask: int(a["has_key_padding_mask"]), s.attr_has_attn_mask: int(a["has_attn_mask"]),
              s.attr_softcap: float(a["softcap"]), s.attr_causal_alignment: int(a["causal_alignment"]),
              s.attr_kv_num_heads: int(a["kv_num_heads"]), s.attr_window: int(a["window"]),
              s.attr_has_past: int(a["has_past"]), s.attr_alibi_slopes: [float(x) for x in a["alibi_slopes"]]}
    fields = []
    for name, kind in expected_fields():
        if name == s.attr_alibi_slopes:
            if not values[name]:
                continue
            array = np.array(values[name], dtype=np.float32)
        else:
            array = np.array([values[name]], dtype=np.int32 if kind == "INT32" else np.float32)
        fields.append(trt.PluginField(name, array, getattr(trt.PluginFieldType, kind)))
    return trt.PluginFieldCollection(fields)


def _string_attr(node: onnx.NodeProto, name: str, default: str) -> str:
    for attr in node.attribute:
        if attr.name == name:
            value = onnx.helper.get_attribute_value(attr)
            return value.decode() if isinstance(value, bytes) else str(value)
    return default


def _value_types(model: onnx.ModelProto) -> Dict[str, int]:
    types: Dict[str, int] = {}
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    return types


def plugin_requests(model: onnx.ModelProto) -> List[PluginRequest]:
    """One request per distinct (name, version, namespace) among the FusedAttention nodes, as
    TensorRT's parser reads them: op_type, and the plugin_version (default "1") and
    plugin_namespace (default "") attributes; the domain is ignored. The element types of the
    nodes' inputs come from the graph's type information (shape inference fills the gaps)."""
    from attn_export.onnx import node as onnx_node

    s = _spec.load()
    nodes = [n for n in model.graph.node if n.op_type == s.plugin_name]
    if not nodes:
        return []
    onnx_node.register_schema()  # for shape inference, and the inputs' type constraints
    formal = onnx.defs.get_schema(s.op_type, s.domain_version, s.domain).inputs  # type "T" or "M" (masks)
    types = _value_types(model)
    if any(i not in types for n in nodes for i in n.input):
        try:
            types = _value_types(onnx.shape_inference.infer_shapes(model))
        except Exception:  # noqa: BLE001 - types stay unknown; TensorRT will judge them
            pass
    requests: Dict[Tuple[str, str, str], PluginRequest] = {}
    for i, node in enumerate(nodes):
        key = (node.op_type, _string_attr(node, s.attr_plugin_version, PARSER_DEFAULT_PLUGIN_VERSION),
               _string_attr(node, s.attr_plugin_namespace, s.attribute[s.attr_plugin_namespace].default))
        request = requests.setdefault(key, PluginRequest(*key))
        label = node.name or f"{node.op_type}#{i}"
        request.nodes.append(label)
        t_types = {}
        for position, input_name in enumerate(node.input[:len(formal)]):
            elem = types.get(input_name)
            if elem is None:
                continue
            if formal[position].type_str == "M" and elem != MASK_ONNX_TYPE:
                raise PluginError(
                    f"node {label}: {s.input_names[position]} is {_onnx_type_name(elem)}; the plugin takes "
                    f"{s.mask_type_name} additive masks (re-export with this attn-export)"
                )
            if formal[position].type_str == "T":
                t_types[s.input_names[position]] = _onnx_type_name(elem)
        if len(set(t_types.values())) > 1:
            raise PluginError(f"node {label}: query, key and value must share one type; got {t_types}")
        if t_types:
            request.types[label] = next(iter(t_types.values()))
    return list(requests.values())


def _onnx_type_name(elem: int) -> str:
    return SUPPORTED_ONNX_TYPES.get(elem) or onnx.TensorProto.DataType.Name(elem).lower()
