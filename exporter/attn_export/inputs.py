"""Example inputs: trtexec-style specs (``src:2x16x64``, ``ids:1x32:int64``), files of named
tensors, dynamic-axis labels, and new inputs at other batch sizes and sequence lengths
generated from the example (floats random, integers within their observed range, boolean
padding masks and 0/1 ``attention_mask`` integers with random valid lengths and at least one
visible key per row).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from attn_export.errors import InputError, first_line as _first_line

Inputs = Dict[str, torch.Tensor]
Axes = Dict[str, Dict[int, str]]  # input name -> {axis: label}

DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


def parse_input_spec(text: str) -> InputSpec:
    """``NAME:DIMS[:DTYPE]`` with DIMS like ``2x16x64`` (trtexec style)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1]:
        raise InputError(f"--input {text!r}: expected NAME:DIMS[:DTYPE], e.g. src:2x16x64 or ids:1x32:int64")
    name, dims = parts[0], parts[1]
    if not _NAME.match(name):
        raise InputError(f"--input {text!r}: {name!r} is not a valid input name")
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        raise InputError(f"--input {text!r}: dimensions must be integers separated by 'x', e.g. 2x16x64") from None
    if any(d < 1 for d in shape):
        raise InputError(f"--input {text!r}: every dimension must be >= 1")
    dtype_name = parts[2].lower() if len(parts) == 3 else "float32"
    if dtype_name not in DTYPES:
        raise InputError(f"--input {text!r}: unknown dtype {parts[2]!r}; one of {', '.join(sorted(DTYPES))}")
    return InputSpec(name, shape, DTYPES[dtype_name])


def parse_dynamic_spec(text: str) -> Tuple[str, int, str]:
    """``NAME:DIM=LABEL``, e.g. ``tgt:1=tgt_len``."""
    m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*):(\d+)=([A-Za-z_][A-Za-z0-9_]*)$", text)
    if not m:
        raise InputError(f"--dynamic {text!r}: expected NAME:DIM=LABEL, e.g. src:1=seq (LABEL an identifier)")
    return m[1], int(m[2]), m[3]


def forward_parameters(model: nn.Module) -> Tuple[List[str], bool]:
    """The names ``model.forward`` takes (positional-or-keyword and keyword-only), and whether
    it also takes ``**kwargs``."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return [], True
    names, var_kw = [], False
    for p in sig.parameters.values():
        if p.kind == p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.append(p.name)
    return names, var_kw


def required_parameters(model: nn.Module) -> List[str]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [
        p.name for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def order_for_model(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> Inputs:
    """``inputs`` checked against ``model.forward`` and ordered like its parameters."""
    params, var_kw = forward_parameters(model)
    unknown = [n for n in inputs if n not in params]
    if unknown and not var_kw:
        raise InputError(
            f"unknown input name(s) {', '.join(unknown)}: {type(model).__name__}.forward takes "
            f"{', '.join(params) or 'no named parameters'}"
        )
    missing = [n for n in required_parameters(model) if n not in inputs]
    if missing:
        raise InputError(
            f"{type(model).__name__}.forward requires {', '.join(missing)}; give it with "
            f"--input {missing[0]}:DIMS[:DTYPE] or in --example-inputs"
        )
    ordered = {n: inputs[n] for n in params if n in inputs}
    ordered.update({n: t for n, t in inputs.items() if n not in ordered})
    return ordered


def int_range_for(model: nn.Module) -> Tuple[int, int]:
    """[low, high) for synthesized integer inputs: the smallest embedding table, else [0, 2)."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    return (0, min(sizes)) if sizes else (0, 2)


def synthesize(specs: Sequence[InputSpec], int_range: Tuple[int, int], seed: int = 0,
               int_ranges: Optional[Mapping[str, Tuple[int, int]]] = None) -> Inputs:
    """Random inputs for ``specs``: integers in ``int_ranges[name]`` (else ``int_range``);
    an integer input named like ``attention_mask`` is a 0/1 padding mask (1 = keep, the
    transformers convention) with random valid lengths, at least one valid token per row."""
    gen = torch.Generator().manual_seed(seed)
    out: Inputs = {}
    for spec in specs:
        if spec.name in out:
            raise InputError(f"--input {spec.name} given twice")
        if _is_integer(spec.dtype) and "attention_mask" in spec.name and len(spec.shape) >= 1:
            out[spec.name] = padding_mask(spec.shape, gen, true_is_masked=False).to(spec.dtype)
            continue
        low_high = (int_ranges or {}).get(spec.name, int_range)
        out[spec.name] = _random_like(spec.shape, spec.dtype, gen, int_range=low_high)
    return out


def _is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _is_int_mask(name: str, t: torch.Tensor) -> bool:
    """An integer 0/1 mask (transformers' ``attention_mask``): named like a mask, values in {0, 1}."""
    if not _is_integer(t.dtype) or t.dim() < 1 or "mask" not in name.lower() or t.numel() == 0:
        return False
    return bool(((t == 0) | (t == 1)).all())


def _random_like(shape, dtype, gen, *, like: Optional[torch.Tensor] = None, int_range=(0, 2)) -> torch.Tensor:
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if like is not None and like.numel() > 1:
            ref = like.float()
            finite = ref[torch.isfinite(ref)]
            if finite.numel() > 1:
                t = t * finite.std().clamp_min(1e-3) + finite.mean()
        return t.to(dtype)
    if dtype == torch.bool:
        return padding_mask(shape, gen, true_is_masked=True)
    low, high = int_range
    if like is not None and like.numel() > 0:
        low, high = int(like.min()), int(like.max()) + 1
    return torch.randint(low, max(high, low + 1), shape, generator=gen, dtype=dtype)


def padding_mask(shape, gen, *, true_is_masked: bool = True) -> torch.Tensor:
    """A boolean mask over the last axis with a random valid length in [1, L] per row
    (always at least one visible position)."""
    shape = tuple(shape)
    if len(shape) == 0:
        return torch.tensor(not true_is_masked)
    length = shape[-1]
    rows = int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1
    valid = torch.randint(1, length + 1, (rows, 1), generator=gen)
    if rows > 1:
        valid[0] = length  # one full row
    masked = torch.arange(length).unsqueeze(0) >= valid
    mask = masked if true_is_masked else ~masked
    return mask.reshape(shape)


def _mask_convention(mask: torch.Tensor) -> Optional[bool]:
    """True if rows look like [F..F T..T] (true = padding), False for [T..T F..F], else None."""
    if mask.dim() == 0 or mask.shape[-1] == 0:
        return None
    rows = mask.reshape(-1, mask.shape[-1])
    as_int = rows.to(torch.int8)
    nondecreasing = bool((as_int[:, 1:] >= as_int[:, :-1]).all())
    nonincreasing = bool((as_int[:, 1:] <= as_int[:, :-1]).all())
    if nondecreasing and not nonincreasing:
        return True
    if nonincreasing and not nondecreasing:
        return False
    return None


def default_axes(inputs: Mapping[str, torch.Tensor]) -> Axes:
    """Dim 0 of every input is the batch and dim 1 its sequence: ``batch`` and ``seq`` for the
    first input, ``<name>_seq`` for the others (sequences the model ties together end up as one
    symbol after export, independent ones stay independent; the batches are one symbol where
    the example's sizes agree, attn_export.onnx.dims). A 4-D floating input is an image batch
    (``[B, C, H, W]``): its batch only, dim 1 being channels."""
    axes: Axes = {}
    first = True
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        axes[name] = {0: "batch"}
        if t.dim() >= 2 and not (t.dim() == 4 and t.is_floating_point()):
            axes[name][1] = "seq" if first else f"{name}_seq"
        first = False
    return axes


def resolve_axes(inputs: Mapping[str, torch.Tensor], overrides: Sequence[Tuple[str, int, str]] = (),
                 static: bool = False, defaults: Optional[Axes] = None) -> Axes:
    """The dynamic axes to export: the defaults (:func:`default_axes` unless given; none with
    ``static``) with ``overrides`` applied."""
    base = default_axes(inputs) if defaults is None else defaults
    axes: Axes = {} if static else {name: dict(dims) for name, dims in base.items()}
    overridden = set()
    for name, dim, label in overrides:
        if name not in inputs:
            raise InputError(f"--dynamic {name}:{dim}={label}: no input named {name!r} (inputs: {', '.join(inputs)})")
        if dim >= inputs[name].dim():
            raise InputError(f"--dynamic {name}:{dim}={label}: {name} has only {inputs[name].dim()} dimensions")
        if name not in overridden:  # a --dynamic for an input replaces its defaults
            axes[name] = {}
            overridden.add(name)
        axes[name][dim] = label
    return {name: dims for name, dims in axes.items() if dims}


def label_is_batch(label: str) -> bool:
    return "batch" in label.lower()


def label_sizes(inputs: Mapping[str, torch.Tensor], axes: Axes) -> Dict[str, int]:
    """The example's size for every label (the first axis carrying it)."""
    sizes: Dict[str, int] = {}
    for name, dims in axes.items():
        for dim, label in dims.items():
            sizes.setdefault(label, int(inputs[name].shape[dim]))
    return sizes


def resize(inputs: Mapping[str, torch.Tensor], axes: Axes, sizes: Mapping[str, int], seed: int = 0) -> Inputs:
    """New inputs where every axis labelled in ``sizes`` has that size. Inputs whose shape does
    not change are returned as they are; the others are generated from them: floats random with
    the example's mean and std, integers within the example's range, boolean masks with random
    valid lengths (the example's convention, true = padding unless it looked otherwise), and
    0/1 integer masks named like a mask (transformers' ``attention_mask``) likewise, 1 = keep
    unless the example rows looked like 0..0 1..1."""
    gen = torch.Generator().manual_seed(seed)
    out: Inputs = {}
    for name, t in inputs.items():
        dims = axes.get(name, {})
        shape = [sizes.get(dims[d], s) if d in dims else s for d, s in enumerate(t.shape)]
        if list(t.shape) == shape:
            out[name] = t
        elif t.dtype == torch.bool:
            convention = _mask_convention(t)
            out[name] = padding_mask(shape, gen, true_is_masked=convention is not False)
        elif _is_int_mask(name, t):
            # 0/1 integers: 1 = keep (transformers' attention_mask) unless the rows look like 0..0 1..1
            convention = _mask_convention(t != 0)
            out[name] = padding_mask(shape, gen, true_is_masked=convention is True).to(t.dtype)
        else:
            out[name] = _random_like(shape, t.dtype, gen, like=t)
    return out


def load_example_file(path: str | Path) -> Inputs:
    """A ``torch.save``-d dict name -> tensor, loaded weights-only (no code runs)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--example-inputs {path}: no such file")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is a bad input file
        raise InputError(f"--example-inputs {path}: cannot load it weights-only ({_first_line(exc)})") from exc
    if not isinstance(data, dict) or not data or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise InputError(f"--example-inputs {path}: expected a non-empty dict of name -> tensor")
    return dict(data)


def from_attribute(model: nn.Module) -> Optional[Inputs]:
    """The model's own ``example_inputs`` attribute (a dict, or a tuple in forward order)."""
    value = getattr(model, "example_inputs", None)
    if callable(value):
        value = value()
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = (value,)
    if isinstance(value, (tuple, list)):
        params, _ = forward_parameters(model)
        if len(value) > len(params):
            raise InputError(f"model.example_inputs has {len(value)} entries but forward takes {len(params)}")
        value = dict(zip(params, value))
    if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
        raise InputError("model.example_inputs must be a tensor, a tuple of tensors or a dict name -> tensor")
    return dict(value)


def cast_floats(inputs: Mapping[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Inputs:
    if dtype is None:
        return dict(inputs)
    return {n: (t.to(dtype) if t.dtype.is_floating_point else t) for n, t in inputs.items()}


def describe(inputs: Mapping[str, torch.Tensor]) -> Dict[str, List[int]]:
    return {n: list(t.shape) for n, t in inputs.items()}
