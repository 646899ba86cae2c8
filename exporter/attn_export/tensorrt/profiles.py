"""Optimization profiles: min/opt/max shapes per engine input, derived from the ONNX graph's
symbolic dimensions and the sizes the validator sweeps (trtexec's --minShapes/--optShapes/
--maxShapes)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import onnx
import torch

from attn_export import shapes as _shapes
from attn_export.errors import InputError

Dims = Tuple[int, ...]


@dataclass
class ShapeProfile:
    """min/opt/max shape per engine input, and the size range of every symbolic dimension."""

    shapes: Dict[str, Tuple[Dims, Dims, Dims]]
    labels: Dict[str, Tuple[int, int, int]]

    def to_dict(self) -> dict:
        return {
            "inputs": {n: {"min": list(mn), "opt": list(op), "max": list(mx)} for n, (mn, op, mx) in self.shapes.items()},
            "dimensions": {lbl: {"min": a, "opt": b, "max": c} for lbl, (a, b, c) in self.labels.items()},
        }

    def lines(self) -> List[str]:
        fmt = lambda d: "x".join(map(str, d))  # noqa: E731
        return [f"{n}: min {fmt(mn)}  opt {fmt(op)}  max {fmt(mx)}" for n, (mn, op, mx) in self.shapes.items()]

    def outside(self, shapes: Mapping[str, Sequence[int]]) -> Optional[str]:
        """Why these input shapes fall outside the profile, or None."""
        for name, shape in shapes.items():
            if name not in self.shapes:
                continue
            mn, _, mx = self.shapes[name]
            for axis, (lo, size, hi) in enumerate(zip(mn, shape, mx)):
                if not lo <= size <= hi:
                    return f"{name}[{axis}]={size} is outside the engine's profile [{lo}, {hi}]"
        return None


def parse_shape_specs(texts: Sequence[str], option: str) -> Dict[str, Dims]:
    """trtexec-style ``NAME:DIMS`` specs (``src:1x16x64``), repeatable and/or comma-separated."""
    out: Dict[str, Dims] = {}
    for text in texts:
        for part in filter(None, (p.strip() for p in text.split(","))):
            m = re.fullmatch(r"([A-Za-z_][\w.\-/]*):(\d+(?:x\d+)*)", part)
            if not m:
                raise InputError(f"{option} {part!r}: expected NAME:DIMS, e.g. src:1x16x64")
            if m[1] in out:
                raise InputError(f"{option}: {m[1]} given twice")
            out[m[1]] = tuple(int(d) for d in m[2].split("x"))
    return out


def graph_input_dims(model: onnx.ModelProto) -> Dict[str, List[object]]:
    """Engine inputs (graph inputs that are not initializers) -> per axis: an int (static) or a
    label (str: the dim_param, or ``NAME:AXIS`` for an unnamed dynamic axis)."""
    inits = {i.name for i in model.graph.initializer}
    out: Dict[str, List[object]] = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        dims: List[object] = []
        for axis, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param if d.HasField("dim_param") and d.dim_param else f"{value.name}:{axis}")
        out[value.name] = dims
    return out


def dynamic_overrides(inputs: Mapping[str, List[object]], given: Optional[Mapping[str, Dims]],
                      option: str) -> Iterator[Tuple[str, int, str, int]]:
    """(input, axis, label, size) for each dynamic axis that one of --min/--opt/--max-shapes
    (``option``: full shapes by input name) sizes; InputError for an unknown input, a wrong rank or
    a static dimension given another size."""
    for name, shape in (given or {}).items():
        if name not in inputs:
            raise InputError(f"{option} {name}: no such engine input (inputs: {', '.join(inputs)})")
        dims = inputs[name]
        if len(shape) != len(dims):
            raise InputError(f"{option} {name}:{'x'.join(map(str, shape))}: {name} has rank {len(dims)}")
        for axis, (d, size) in enumerate(zip(dims, shape)):
            if isinstance(d, int):
                if size != d:
                    raise InputError(f"{option} {name}[{axis}]={size}: that dimension is static ({d})")
                continue
            yield name, axis, d, size


def derive_profile(
    model: onnx.ModelProto,
    example_inputs: Mapping[str, torch.Tensor],
    *,
    min_shapes: Optional[Mapping[str, Dims]] = None,
    opt_shapes: Optional[Mapping[str, Dims]] = None,
    max_shapes: Optional[Mapping[str, Dims]] = None,
) -> ShapeProfile:
    """One optimization profile from the ONNX graph's symbolic dimensions.

    Defaults per symbolic dimension (a dim_param shared by several inputs is one dimension):
    opt = its size in the example inputs; min = 1; max = 4 x the example size, and at least every
    size ``attn-export validate`` sweeps (batch 1, sequence 1, an odd and a long sequence), so that
    validating the engine checks every case. ``min_shapes``/``opt_shapes``/``max_shapes``
    (input -> full shape, as --min-shapes etc.) override the dimensions they mention; static
    dimensions must be given as they are. InputError when the shapes disagree.
    """
    inputs = graph_input_dims(model)
    example = _example_sizes(inputs, example_inputs)
    bounds = _default_bounds(inputs, example)
    for which, given, option in ((0, min_shapes, "--min-shapes"), (1, opt_shapes, "--opt-shapes"),
                                 (2, max_shapes, "--max-shapes")):
        _apply_overrides(bounds, which, inputs, given, option)
    for label, (lo, opt, hi) in bounds.items():
        if not lo <= opt <= hi:
            raise InputError(f"profile for dimension {label!r}: need min <= opt <= max; got {lo}, {opt}, {hi}")

    shapes: Dict[str, Tuple[Dims, Dims, Dims]] = {}
    for name, dims in inputs.items():
        shapes[name] = tuple(  # type: ignore[assignment]
            tuple(d if isinstance(d, int) else bounds[d][which] for d in dims) for which in range(3)
        )
    return ShapeProfile(shapes=shapes, labels={lbl: tuple(b) for lbl, b in bounds.items()})  # type: ignore[misc]


def _example_sizes(inputs: Mapping[str, List[object]], example_inputs: Mapping[str, torch.Tensor]) -> Dict[str, int]:
    """Each symbolic dimension's size in the example inputs (the first input that has it says),
    after checking that every graph input has an example of its rank that agrees with its static
    dimensions."""
    missing = [n for n in inputs if n not in example_inputs]
    if missing:
        raise InputError(f"the engine's input(s) {', '.join(missing)} have no example input to size the profile")
    example: Dict[str, int] = {}
    for name, dims in inputs.items():
        shape = tuple(example_inputs[name].shape)
        if len(shape) != len(dims):
            raise InputError(f"example input {name} has shape {list(shape)}, the ONNX input has rank {len(dims)}")
        for axis, (d, size) in enumerate(zip(dims, shape)):
            if isinstance(d, int) and d != size:
                raise InputError(f"example input {name}[{axis}] is {size}; the ONNX graph fixes it to {d}")
            if isinstance(d, str):
                example.setdefault(d, int(size))
    return example


def _default_bounds(inputs: Mapping[str, List[object]], example: Dict[str, int]) -> Dict[str, List[int]]:
    """[min, opt, max] per symbolic dimension: 1, the example size, and 4 x the example size but
    at least every size the validation's shape cases sweep."""
    kinds = _shapes.label_kinds({n: {a: d for a, d in enumerate(dims) if isinstance(d, str)} for n, dims in inputs.items()})
    swept: Dict[str, int] = dict(example)
    for _, overrides in _shapes.shape_cases(example, kinds):
        for label, size in overrides.items():
            swept[label] = max(swept[label], size)
    return {label: [1, size, max(4 * size, swept[label])] for label, size in example.items()}


def _apply_overrides(bounds: Dict[str, List[int]], which: int, inputs: Mapping[str, List[object]],
                     given: Optional[Mapping[str, Dims]], option: str) -> None:
    """Sets ``bounds[d][which]`` (0: min, 1: opt, 2: max) for every symbolic dimension ``option``
    gives a size; the sizes must be >= 1 and agree where the graph ties axes together."""
    set_here: Dict[str, Tuple[str, int]] = {}
    for name, axis, d, size in dynamic_overrides(inputs, given, option):
        if size < 1:
            raise InputError(f"{option} {name}[{axis}]={size}: sizes must be >= 1")
        if d in set_here and set_here[d][1] != size:
            raise InputError(
                f"{option}: dimension {d!r} is {set_here[d][1]} in {set_here[d][0]} but {size} in "
                f"{name}[{axis}] (the ONNX graph ties them together)"
            )
        set_here[d] = (f"{name}[{axis}]", size)
        bounds[d][which] = size
