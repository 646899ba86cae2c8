"""Reading and writing nodes of a ``torch.export`` ATen graph: values, real users, constants, the
module a node came from, and new nodes with their fake values."""
from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch

from attn_export.surgery.sdpa.translate import known_equal as same  # noqa: F401 - shared by the modules here

aten = torch.ops.aten
Node = torch.fx.Node

# Export's runtime checks read a tensor without being part of the computation.
_CHECKS = (aten._assert_tensor_metadata.default,)
# Nodes that hold a 0-d constant: torch.full([], c), torch.scalar_tensor(c).
_SCALAR_MAKERS = (aten.full.default, aten.scalar_tensor.default)
_DEAD_IF_UNREAD = (aten.clone.default, aten.detach.default, aten.alias.default, aten.view.default,
                   aten.reshape.default)
CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default)


class NoMatch(Exception):
    """The idiom that stopped the match, in words."""


def val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _dead(user) -> bool:
    """A copy nothing reads (x-transformers keeps ``sim.clone()`` for intermediates it may drop)."""
    return not user.users and user.target in _DEAD_IF_UNREAD


def users(node) -> List[Node]:
    """The users that compute with ``node`` (not export's metadata assertions, not unread copies)."""
    return [u for u in node.users if u.target not in _CHECKS and not _dead(u)]


def checks(node) -> List[Node]:
    """Users that go when ``node`` goes: metadata assertions and unread copies."""
    return [u for u in node.users if u.target in _CHECKS or _dead(u)]


def shape_users(node) -> List[Node]:
    """Users that read only ``node``'s shape: ``x.expand_as(node)``."""
    return [u for u in users(node) if u.target == aten.expand_as.default and u.args[1] is node
            and u.args[0] is not node]


def only_user(node, shapes: Optional[List[Node]] = None, ignore=()) -> Node:
    """The one user of an intermediate tensor; a second user (weights also returned, reused)
    means the graph must compute it as written. With ``shapes``, users that read only its
    shape are collected there instead of counted; users in ``ignore`` are part of the match."""
    found = [u for u in users(node) if u not in ignore]
    if shapes is not None:
        readers = shape_users(node)
        shapes.extend(readers)
        found = [u for u in found if u not in readers]
    if len(found) != 1:
        raise NoMatch(f"{node.name} ({node.target}) has {len(found)} users (an intermediate of the attention is "
                      "used elsewhere too, e.g. the weights are returned)")
    return found[0]


def cast_dtype(node) -> Optional[torch.dtype]:
    """The dtype a cast node converts to (``.to(dtype)``, ``.float()``, ``.type_as``), else None."""
    if not isinstance(node, Node) or node.target not in CASTS:
        return None
    if node.target == aten.type_as.default:
        return val(node.args[1]).dtype
    if node.target == aten.to.dtype:
        return node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    return node.kwargs.get("dtype", val(node).dtype if val(node) is not None else None)


class Constants:
    """Numbers a graph holds as 0-d tensors: ``torch.full([], c)``, ``torch.scalar_tensor(c)``,
    and lifted constants (``torch.tensor(c)`` in the model's code)."""

    def __init__(self, exported):
        sig = exported.graph_signature
        self._lifted = {}
        for name, target in getattr(sig, "inputs_to_lifted_tensor_constants", {}).items():
            tensor = exported.constants.get(target)
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 0:
                self._lifted[name] = tensor.item()

    def number(self, x) -> Optional[float]:
        """``x`` as a Python number when the graph fixes it, else None."""
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            return float(x)
        if not isinstance(x, Node):
            return None
        if x.target in _SCALAR_MAKERS and (x.target != aten.full.default or list(x.args[0]) == []):
            return self.number(x.args[1] if x.target == aten.full.default else x.args[0])
        if x.target in (aten.lift_fresh_copy.default, aten.detach_.default, aten.detach.default, aten.clone.default):
            return self.number(x.args[0])
        if x.op == "placeholder":
            return self._lifted.get(x.name)
        return None


def finite_nonzero(c: Optional[float]) -> bool:
    return c is not None and c != 0 and math.isfinite(c)


def site(node):
    """(module path, class) of the module whose forward holds ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    if path.startswith("L['self']."):
        path = path[len("L['self']."):]
    cls = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    return path, cls


class Builder:
    """Appends nodes before a fixed point of the graph, each with its fake value."""

    def __init__(self, graph, fake_mode, before: Node):
        self.graph, self.fake_mode, self.before = graph, fake_mode, before

    def call(self, target: Callable, *args, **kwargs) -> Node:
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(target, args, kwargs)
        unwrap = lambda n: n.meta["val"]  # noqa: E731
        with self.fake_mode:
            node.meta["val"] = target(*torch.fx.node.map_arg(args, unwrap), **torch.fx.node.map_arg(kwargs, unwrap))
        return node

    def size(self, node: Node, axis: int):
        """``node.size(axis)``: an int, or a ``sym_size`` node for a symbolic size."""
        size = val(node).shape[axis]
        if isinstance(size, int):
            return size
        with self.graph.inserting_before(self.before):
            sym = self.graph.call_function(aten.sym_size.int, (node, axis % val(node).dim()))
        sym.meta["val"] = size
        return sym

    def sizes(self, node: Node) -> list:
        return [self.size(node, i) for i in range(val(node).dim())]
