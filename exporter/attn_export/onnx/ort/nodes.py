"""What the ORT lowering reads off a FusedAttention node: its attributes with the spec's
defaults, and the contrib domain's opset import."""
from __future__ import annotations

from typing import Dict

import onnx
from onnx import helper

from attn_export import spec as _spec

MS_DOMAIN = "com.microsoft"


def attrs(node: onnx.NodeProto) -> Dict[str, object]:
    """The node's attributes, the spec's default where the node leaves one out."""
    s = _spec.load()
    values = {a.name: a.default for a in s.attributes}
    values.update({a.name: helper.get_attribute_value(a) for a in node.attribute})
    return values


def has_past(node: onnx.NodeProto) -> bool:
    return bool(attrs(node)[_spec.load().attr_has_past])


def import_ms_domain(model: onnx.ModelProto) -> None:
    """``com.microsoft`` version 1 among the model's opset imports (once)."""
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
