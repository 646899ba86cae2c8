"""label_axes: the graph's symbolic dimensions renamed to the requested axis labels (``batch``,
``sequence``, ...). An axis declared dynamic (``context.required``) that came out static is an
error; a default one stays static, with a note."""
from __future__ import annotations

import re
from typing import Dict, List, Mapping

import onnx

from attn_export.errors import ExportError
from attn_export.onnx.editing import dim_of
from attn_export.onnx.passes.base import GraphPass, PassContext, PassOutcome


class LabelAxes(GraphPass):
    name = "label_axes"

    def run(self, model: onnx.ModelProto, context: PassContext) -> PassOutcome:
        context.labels, static = apply_axis_labels(model, context.axes)
        notes = []
        if static:
            listed = ", ".join(f"{n}:{a} ({lbl}, came out as {v})" for n, a, lbl, v in static)
            if context.required:
                raise ExportError(
                    f"axes declared dynamic came out static: {listed}. The model specializes them (a shape-dependent "
                    "branch or a constant size inside); give --dynamic to declare the right axes or --static"
                )
            notes.append(f"default dynamic axes the model specializes stay static: {listed} (--dynamic declares others)")
        return PassOutcome(sum(len(d) for d in context.labels.values()), tuple(notes))


def apply_axis_labels(model: onnx.ModelProto, axes: Mapping[str, Mapping[int, str]]) -> tuple[dict, list]:
    """Renames the graph's symbolic dims to the requested labels. Returns the labels per input
    as they came out and the declared axes that came out static."""
    _normalize_numeric_dims(model)
    mapping: Dict[str, str] = {}
    taken: Dict[str, str] = {}
    static = []
    for name, dims in axes.items():
        graph_dims = _graph_dims(model, name)
        for axis, label in dims.items():
            symbol = graph_dims[axis]
            if not isinstance(symbol, str) or not symbol:
                static.append((name, axis, label, symbol))
                continue
            if symbol in mapping:
                continue
            final = label if label not in taken else f"{label}_{name}"
            mapping[symbol] = final
            taken[final] = symbol
    # Symbols that are not labels yet must not collide with a label.
    rename_symbols(model, mapping)
    result = {}
    for name in axes:
        graph_dims = _graph_dims(model, name)
        result[name] = {axis: graph_dims[axis] for axis in axes[name] if isinstance(graph_dims[axis], str)}
    return result, static


def _graph_dims(model: onnx.ModelProto, name: str) -> List[object]:
    for value in model.graph.input:
        if value.name == name:
            return [dim_of(d) for d in value.type.tensor_type.shape.dim]
    raise KeyError(name)


def _normalize_numeric_dims(model: onnx.ModelProto) -> None:
    """torch's exporter can write a specialized size as dim_param "5"; make it dim_value 5."""
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and re.fullmatch(r"\d+", dim.dim_param.strip()):
                dim.dim_value = int(dim.dim_param)


def rename_symbols(model: onnx.ModelProto, mapping: Mapping[str, str]) -> None:
    """Renames symbolic dimensions (whole words of each ``dim_param``) of the graph's inputs,
    outputs and values: ``mapping`` old -> new."""
    if not mapping:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)) + r")\b")
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for value in values:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_param = pattern.sub(lambda m: mapping[m.group(1)], dim.dim_param)
