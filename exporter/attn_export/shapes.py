"""The shapes a parity check sweeps, and which graph axes they move.

Both the validator (attn_export.validation) and the TensorRT profile (attn_export.tensorrt)
read these, so an engine built with the default profile covers every case the validator runs.

    >>> axes = graph_axes(onnx.load("model.onnx"), ["src"])     # {"src": {0: "batch", 1: "seq"}}
    >>> shape_cases({"batch": 2, "seq": 16}, label_kinds(axes))
    [("example", {}), ("batch=1", {"batch": 1}), ("seq=1", {"seq": 1}), ("seq=odd", {"seq": 7}), ...]
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Tuple

Axes = Mapping[str, Mapping[int, str]]


def graph_axes(onnx_model, names: List[str]) -> Dict[str, Dict[int, str]]:
    """input -> {axis: dim_param} for the symbolic axes of the ONNX graph's inputs."""
    axes: Dict[str, Dict[int, str]] = {}
    for value in onnx_model.graph.input:
        if value.name not in names:
            continue
        dims = {}
        for i, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_param") and d.dim_param and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", d.dim_param):
                dims[i] = d.dim_param
        if dims:
            axes[value.name] = dims
    return axes


def label_kinds(axes: Axes) -> Dict[str, str]:
    """label -> "batch" | "seq": by the label's name when it says so, else by position (dim 0
    is a batch, the others sequences)."""
    kinds: Dict[str, str] = {}
    for dims in axes.values():
        for axis, label in dims.items():
            if label in kinds:
                continue
            low = label.lower()
            if "batch" in low:
                kinds[label] = "batch"
            elif "seq" in low or "len" in low:
                kinds[label] = "seq"
            else:
                kinds[label] = "batch" if axis == 0 else "seq"
    return kinds


def shape_cases(example_sizes: Mapping[str, int], kinds: Mapping[str, str]) -> List[Tuple[str, Dict[str, int]]]:
    """[(name, {label: size})]: example, batch=1, seq=1, seq=odd, seq=long (sequence labels
    get distinct sizes so independent lengths are exercised as independent)."""
    batch = [lbl for lbl in example_sizes if kinds.get(lbl) == "batch"]
    seq = [lbl for lbl in example_sizes if kinds.get(lbl) == "seq"]
    cases = [("example", {})]
    if batch:
        cases.append(("batch=1", {lbl: 1 for lbl in batch}))
    if seq:
        longest = max(example_sizes[lbl] for lbl in seq)
        odd = 9 if any(example_sizes[lbl] == 7 for lbl in seq) else 7
        cases.append(("seq=1", {lbl: 1 for lbl in seq}))
        cases.append(("seq=odd", {lbl: odd + 2 * i for i, lbl in enumerate(seq)}))
        long = max(2 * longest, 48)
        cases.append(("seq=long", {lbl: long + 2 * i for i, lbl in enumerate(seq)}))
    return cases
