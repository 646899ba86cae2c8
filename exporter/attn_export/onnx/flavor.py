"""Which attention flavor an exported file uses, read from its nodes."""
from __future__ import annotations

from typing import Dict

import onnx

from attn_export import spec as _spec
from attn_export.onnx.editing import DEFAULT_DOMAINS, attention_nodes


def attention_flavor(model: onnx.ModelProto) -> Dict[str, object]:
    """Which flavor a file uses, from its nodes: ``{"flavor": "custom" | "standard" | "mixed" |
    "none", "custom_nodes": n, "standard_nodes": m, "text": one line}``. "mixed" is the standard
    flavor with layers kept custom."""
    s = _spec.load()
    custom = len(attention_nodes(model))
    standard = sum(1 for n in model.graph.node if n.op_type == "Attention" and n.domain in DEFAULT_DOMAINS)
    flavor = {(True, False): "custom", (False, True): "standard", (True, True): "mixed"}.get((custom > 0, standard > 0), "none")
    parts = [f"{custom} {s.domain}.{s.op_type}"] if custom else []
    parts += [f"{standard} standard Attention (opset 23)"] if standard else []
    text = f"{flavor}: " + (" + ".join(parts) + " node(s)" if parts else "no attention node")
    return {"flavor": flavor, "custom_nodes": custom, "standard_nodes": standard, "text": text}
