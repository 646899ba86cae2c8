"""The names of an exported model's outputs: the flattened outputs of ``model.forward``."""
from __future__ import annotations

import re
from typing import List, Mapping

import torch


def output_names_for(outputs, taken=()) -> List[str]:
    """Names of the flattened outputs: ``output`` for one tensor, ``output_0``... for a tuple,
    the keys for a dict (nested containers joined with ``_``); a name in ``taken`` (the input
    names: an ONNX graph names every value once) gets ``_output`` appended."""
    from torch.utils import _pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path(_plain(outputs))
    if len(leaves) == 1 and not leaves[0][0]:
        return ["output"]
    names = []
    for path, _ in leaves:
        parts = []
        for key in path:
            for attr in ("key", "idx", "name"):
                if hasattr(key, attr):
                    parts.append(str(getattr(key, attr)))
                    break
        name = "_".join(parts)
        names.append(name if re.match(r"^[A-Za-z_]", name) else f"output_{name}")
    taken = set(taken)
    unique = []
    for name in names:
        while name in taken:
            name = f"{name}_output"
        taken.add(name)
        unique.append(name)
    return unique


def flatten_outputs(outputs) -> List[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(_plain(outputs))]


def _plain(outputs):
    """Mappings of other types (transformers' ModelOutput, which older transformers registers
    with torch's pytree without key paths) as plain dicts, in their own order."""
    if isinstance(outputs, Mapping) and type(outputs) is not dict:
        return {k: _plain(v) for k, v in outputs.items()}
    if isinstance(outputs, dict):
        return {k: _plain(v) for k, v in outputs.items()}
    if type(outputs) in (list, tuple):
        return type(outputs)(_plain(v) for v in outputs)
    return outputs
