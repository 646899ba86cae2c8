"""torch.export's Dims for the axes an export makes dynamic: which axes share one symbol.

torch.export gives every dynamic axis a symbol and merges two symbols only when the traced code
proves the sizes equal (a broadcast, a concatenation, a matmul). Sequence axes are left to that
proof (``Dim.AUTO``): a mask's length that the model adds to the tokens' comes out as the tokens'
``seq``, an independent length keeps its own label. The batch cannot be left to it: models tie
their inputs' batches by indexing (transformers builds a padding mask as
``attention_mask[arange(batch)]``), which proves nothing, so every input would bring its own
batch symbol (``batch``, ``batch_attention_mask``) and ONNX Runtime and TensorRT profiles would
see independent batches that are not.

So the inputs' batch axes are declared one axis: one ``Dim("batch")`` shared by every axis
labelled ``batch``, where the example's sizes on them agree. This is a declaration that
torch.export traces under and checks, not a rename after the fact: renaming two symbols
torch.export kept apart would state an equality the graph was never traced for; a shared Dim
makes the graph exactly what the symbol says (correct for equal batches), and torch.export
refuses it where the model contradicts it (a batch the model fixes to a constant). What a
shared Dim could still get wrong is a batch that the trace then ties to another declared axis
(a ``[L, L]`` mask whose first axis only looked like a batch, at an example with batch == L):
:func:`absorbed` finds that, and the export is traced again with separate batch symbols, as it
is where torch.export refuses the shared Dim. Inputs whose example batches differ keep separate
symbols, with a note; so do batches declared with labels of their own (``--dynamic``).

Labels other than the defaults' (``--dynamic``) that name several axes share one named Dim too,
as given.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Set, Tuple

import torch

from attn_export import inputs as _inputs

Axes = Mapping[str, Mapping[int, str]]

# The label the default axes (attn_export.inputs.default_axes and the transformers defaults) give
# every input's dim 0.
BATCH = "batch"


def shared_labels(inputs: Mapping[str, torch.Tensor], axes: Axes) -> Tuple[Set[str], List[str]]:
    """The labels that become one named Dim, and notes on the batch axes kept apart: every label
    on several axes except the defaults' sequence labels (left to torch.export's proof), and
    ``batch`` only where the example's sizes on its axes agree."""
    defaults = {label for dims in _inputs.default_axes(inputs).values() for label in dims.values()}
    sizes: Dict[str, Dict[str, int]] = {}
    for name, dims in axes.items():
        for axis, label in dims.items():
            sizes.setdefault(label, {})[f"{name}[{axis}]"] = int(inputs[name].shape[axis])
    shared, notes = set(), []
    for label, where in sizes.items():
        if len(where) < 2 or (label in defaults and label != BATCH):
            continue
        if label == BATCH and len(set(where.values())) > 1:
            listed = ", ".join(f"{axis}={size}" for axis, size in where.items())
            notes.append(f"the example inputs' batch sizes differ ({listed}): their batch axes are separate "
                         f"symbols ({BATCH}, {BATCH}_<input>)")
            continue
        shared.add(label)
    return shared, notes


def dynamic_shapes(inputs: Mapping[str, torch.Tensor], axes: Axes, shared: Set[str]):
    """torch.export's ``dynamic_shapes``: one named Dim per ``shared`` label, ``Dim.AUTO`` for
    every other declared axis (the model decides which of them are tied)."""
    from torch.export import Dim

    named = {label: Dim(label) for label in sorted(shared)}
    shapes = {}
    for name in inputs:
        dims = axes.get(name)
        shapes[name] = {axis: named.get(label, Dim.AUTO) for axis, label in dims.items()} if dims else None
    return shapes


def absorbed(exported, axes: Axes, shared: Set[str]) -> List[str]:
    """Declared axes of another label that the trace tied to a shared label's symbol (their
    sizes came out one symbol although they were declared different axes): ``input[axis]
    (label)`` for each."""
    symbols = _axis_symbols(exported, axes)
    owner = {}
    for (name, axis), symbol in symbols.items():
        if axes[name][axis] in shared:
            owner.setdefault(symbol, axes[name][axis])
    return [f"{name}[{axis}] ({axes[name][axis]})" for (name, axis), symbol in symbols.items()
            if symbol in owner and owner[symbol] != axes[name][axis]]


def _axis_symbols(exported, axes: Axes) -> Dict[Tuple[str, int], str]:
    """(input, axis) -> the symbolic size torch.export traced it with, for the declared axes
    that came out symbolic."""
    from torch.utils import _pytree as pytree

    # The user inputs' placeholders, in the order of the flattened example (kwargs by name).
    leaves, _ = pytree.tree_flatten_with_path(exported.example_inputs)
    names = [getattr(path[-1], "key", None) for path, _ in leaves]
    nodes = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    out = {}
    for name, node_name in zip(names, exported.graph_signature.user_inputs):
        shape = getattr(nodes[node_name].meta.get("val"), "shape", None) if name in axes else None
        for axis in axes.get(name, {}) if shape is not None else ():
            if axis < len(shape) and isinstance(shape[axis], torch.SymInt):
                out[(name, axis)] = str(shape[axis])
    return out
