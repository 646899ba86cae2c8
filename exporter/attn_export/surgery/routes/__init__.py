"""The routes to the fused operator, in one table.

Each route is one module implementing :class:`~attn_export.surgery.routes.base.Route`: find its
sites (``claim``), say why a module it cannot reach is refused (``decline``), ``apply``, ``undo``,
count what ran at a site (``calls``). :func:`attn_export.replace_attention`,
:func:`attn_export.inspect_attention` and the export's plan walk the model and ask the routes of
:data:`ROUTES` in this order: the first that claims a module owns it, and the routes apply in this
order (undo runs in reverse). A new route is one module and one line here (or, for a while,
``with registered(route):``); everything the report says about its sites comes from the route.

Graph patterns (:mod:`attn_export.surgery.patterns`) are not a route: they rewrite a captured
graph (a copy made by ``torch.export``), so they have nothing to apply to the model or undo; the
export adds their rows to the report after capture (``ReplacementReport.add_pattern_sites``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

from torch import nn

from attn_export.surgery.routes.alibi import AlibiLayers
from attn_export.surgery.routes.base import CallCount, Route
from attn_export.surgery.routes.diffusers import DiffusersProcessors
from attn_export.surgery.routes.module_swap import ModuleSwap
from attn_export.surgery.routes.sdpa import SdpaCalls
from attn_export.surgery.routes.transformers import TransformersLayers

# Precedence: a transformers layer may also call SDPA (attn_implementation="sdpa"): it is routed
# through transformers' interface, not intercepted; a diffusers attention module's calls run
# through its processor (diffusers' own API), not through an instance forward. Bloom's and MPT's
# attention (the alibi route) compute attention themselves: no other route claims them.
ROUTES: List[Route] = [
    TransformersLayers(),
    AlibiLayers(),
    DiffusersProcessors(),
    SdpaCalls(),
    ModuleSwap(),
]


@contextlib.contextmanager
def registered(route: Route, before: Optional[str] = None) -> Iterator[Route]:
    """Adds ``route`` to :data:`ROUTES` for the block (ahead of the route named ``before``, else
    last) and takes it out again; refuses a name already in the table."""
    names = [r.name for r in ROUTES]
    if not route.name or route.name in names:
        raise ValueError(f"a route needs a name of its own: {route.name!r} (the table has {names})")
    ROUTES.insert(names.index(before) if before is not None else len(ROUTES), route)
    try:
        yield route
    finally:
        ROUTES.remove(route)


def fused_calls(module: nn.Module) -> CallCount:
    """Did the fused operator run at this site: the calls counted at ``module`` since it was
    routed, by whichever route reached it (``CallCount(0, {})`` where none counts; the module route
    does not count, see :mod:`attn_export.surgery.routes.module_swap`)."""
    total = CallCount()
    for route in ROUTES:
        count = route.calls(module)
        if count is not None:
            total = total + count
    return total


__all__ = ["ROUTES", "Route", "CallCount", "fused_calls", "registered"]
