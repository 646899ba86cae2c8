"""Intercepting SDPA calls: :class:`SdpaMode` (a ``TorchFunctionMode``) runs each
``F.scaled_dot_product_attention`` call made while it is active on the operator, and a routed
module's instance ``forward`` (:class:`RoutedForward`) runs the class's forward under it, counting
what ran. Nested routed sites share one mode; the innermost site counts the call."""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Optional

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attn_export.surgery.sdpa.translate import sdpa_via_operator

_state = threading.local()


def is_routed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), RoutedForward)


@contextlib.contextmanager
def routing(site):
    """SDPA calls made inside the block run on the operator and are counted on ``site`` (anything
    with a ``calls`` Counter), or on the innermost site when routed sites nest."""
    stack = getattr(_state, "sites", None)
    if stack is None:
        stack = _state.sites = []
    stack.append(site)
    try:
        if len(stack) == 1:
            with SdpaMode():
                yield
        else:
            yield
    finally:
        stack.pop()


class RoutedForward:
    """The instance ``forward`` of a routed module: the class's forward under :class:`SdpaMode`.
    ``calls`` counts the SDPA calls seen since routing: ``"fused"`` and ``"stock: <reason>"``."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.calls: collections.Counter = collections.Counter()

    def __call__(self, *args, **kwargs):
        with routing(self):
            return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __signature__(self):  # the class forward's, without self (torch.export binds inputs by it)
        import inspect

        signature = inspect.signature(type(self.module).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __getattr__(self, name):  # __name__, __doc__, __code__ ... of the class forward
        if name in ("module", "calls"):
            raise AttributeError(name)
        return getattr(type(self.module).forward, name)

    def __deepcopy__(self, memo):
        import copy

        copied = RoutedForward.__new__(RoutedForward)
        memo[id(self)] = copied
        copied.module = copy.deepcopy(self.module, memo)
        copied.calls = collections.Counter()  # a new model: its own calls are counted
        return copied

    def __reduce__(self):  # pickled as its module: unpickling (not a weights-only load) restores the route
        return (_rebuild, (self.module,))


def _rebuild(module):
    return RoutedForward(module)


def route_module(module: nn.Module) -> None:
    """Routes the SDPA calls of ``module``'s forward to the operator (idempotent)."""
    if not is_routed(module):
        module.forward = RoutedForward(module)


def unroute_module(module: nn.Module) -> None:
    """Removes the route (the instance ``forward``); the SDPA route's undo also puts back an
    instance ``forward`` the module had before."""
    if is_routed(module):
        del module.__dict__["forward"]


def call_counter(module: nn.Module) -> Optional[collections.Counter]:
    """The counter of a routed module's SDPA calls (``"fused"``, ``"stock: <reason>"``); None when
    the module is not routed."""
    forward = module.__dict__.get("forward")
    return forward.calls if isinstance(forward, RoutedForward) else None


class SdpaMode(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` calls on :func:`attn_export.attention` (see the
    module docstring); anything else passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out, reason = sdpa_via_operator(*args, **kwargs)
            stack = getattr(_state, "sites", None)
            if stack:
                stack[-1].calls["fused" if reason is None else f"stock: {reason}"] += 1
            if reason is None:
                return out
        return func(*args, **kwargs)
