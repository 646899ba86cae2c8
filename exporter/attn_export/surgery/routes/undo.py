"""What :func:`attn_export.replace_attention` did to a model, route by route, kept on its report
so that :func:`attn_export.restore_attention` can undo it (as a torch hook handle removes a hook),
and the report can confirm afterwards that the sites ran on the operator."""
from __future__ import annotations

import weakref
from typing import Any, List, Tuple

from torch import nn

from attn_export.surgery.routes.base import Route
from attn_export.surgery.site_report import ALREADY_FUSED, ROUTED, SKIPPED, AttentionLayer


class Surgery:
    """The routes applied to one model, in order, with what each one's undo needs. Holds the
    model weakly: a report kept after its model is gone keeps only what it would put back."""

    def __init__(self, model: nn.Module, steps: List[Tuple[Route, Any]]):
        self._model = weakref.ref(model)
        self._steps = steps
        self.restored = False

    def restore(self, model: nn.Module) -> None:
        if self._model() is not model:
            raise ValueError("this report is of another model: restore_attention takes the model that "
                             "replace_attention changed")
        if self.restored:
            raise ValueError("this surgery was already undone")
        for route, state in reversed(self._steps):
            route.undo(model, state)
        self.restored = True

    def confirm(self, model: nn.Module, layers: List[AttentionLayer]) -> List[str]:
        """After ``model`` ran: each routed site whose route says it did not run on the operator
        (:meth:`Route.unconfirmed`) becomes skipped with the reason. One line per site changed."""
        routes = {route.name: route for route, _ in self._steps}
        changed = []
        for layer in layers:
            route = routes.get(layer.found)
            if route is None or layer.status not in (ROUTED, ALREADY_FUSED):
                continue
            try:
                module = model.get_submodule(layer.path) if layer.path else model
            except AttributeError:
                continue
            reason = route.unconfirmed(module)
            if reason is not None:
                layer.status, layer.reason = SKIPPED, reason
                changed.append(f"{layer.path or '(model)'}: {reason}")
        return changed
