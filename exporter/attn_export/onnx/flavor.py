"""Which attention flavor an exported file uses, read from its nodes."""
from __future__ import annotations

from typing import Dict

import onnx

from attn_export import spec as _spec
from attn_export.onnx.editing import DEFAULT_DOMAINS, attention_nodes


# ONNX Runtime's own attention operators (the ort flavor, attn_export.onnx.ort).
ORT_ATTENTION_OPS = ("GroupQueryAttention", "MultiHeadAttention")


def attention_flavor(model: onnx.ModelProto) -> Dict[str, object]:
    """Which flavor a file uses, from its nodes: ``{"flavor": "custom" | "standard" | "ort" |
    "mixed" | "none", "custom_nodes": n, "standard_nodes": m, "ort_nodes": k, "text": one
    line}``. "mixed" is the standard or ort flavor with layers kept custom. The ort flavor's
    layers count once each, also where a layer is an ``If`` between two forms of its operator."""
    s = _spec.load()
    custom = len(attention_nodes(model))
    standard = sum(1 for n in model.graph.node if n.op_type == "Attention" and n.domain in DEFAULT_DOMAINS)
    ort = sum(1 for n in model.graph.node if _is_ort_attention(n))
    kinds = (custom > 0, standard > 0 or ort > 0)
    flavor = {(True, False): "custom", (True, True): "mixed"}.get(kinds) or (
        "standard" if standard else "ort" if ort else "none")
    parts = [f"{custom} {s.domain}.{s.op_type}"] if custom else []
    parts += [f"{standard} standard Attention (opset 23)"] if standard else []
    parts += [f"{ort} ONNX Runtime attention (com.microsoft)"] if ort else []
    text = f"{flavor}: " + (" + ".join(parts) + " node(s)" if parts else "no attention node")
    return {"flavor": flavor, "custom_nodes": custom, "standard_nodes": standard, "ort_nodes": ort, "text": text}


def _is_ort_attention(node: onnx.NodeProto) -> bool:
    """An ONNX Runtime attention operator, or an ``If`` whose branches are one each."""
    if node.domain == "com.microsoft" and node.op_type in ORT_ATTENTION_OPS:
        return True
    branches = [a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    return node.op_type == "If" and bool(branches) and all(
        any(_is_ort_attention(n) for n in g.node) for g in branches)
