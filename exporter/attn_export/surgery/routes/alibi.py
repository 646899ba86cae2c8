"""The ALiBi route: Bloom's and MPT's attention modules (which compute attention themselves, with
the model's ALiBi tensor, outside transformers' AttentionInterface) get an instance ``forward``
that runs them on the operator with the model's ALiBi as per-head slopes
(:mod:`attn_export.surgery.transformers.alibi`). Sites are found by class; a subclass that
overrides ``forward`` or a module whose settings the slopes cannot express is skipped with the
reason. Undo removes the instance ``forward`` (putting back one the module had before); calls are
counted on it, and a site that made no fused call when the routed model ran is reported as
skipped (:meth:`AlibiLayers.unconfirmed`).
"""
from __future__ import annotations

from typing import List, Optional

from torch import nn

from attn_export.surgery.routes.base import MISSING, CallCount, Route, Scan, Site, restore_attributes, routing_note
from attn_export.surgery.site_report import ALREADY_FUSED, ROUTED, SKIPPED, WILL_ROUTE, AttentionLayer, _qualname
from attn_export.surgery.transformers.alibi import AlibiForward, family_of, overridden


def _routed(module: nn.Module) -> Optional[AlibiForward]:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, AlibiForward) else None


class AlibiLayers(Route):
    name = "alibi"
    by_type = True

    def claim(self, scan: Scan, module: nn.Module, parent: Optional[nn.Module], path: str) -> Optional[AttentionLayer]:
        family = family_of(module)
        if family is None:
            return None
        heads = family.heads(module)
        embed = getattr(module, "hidden_size", None)
        if _routed(module) is not None:
            return AttentionLayer(path, _qualname(module), heads, embed, ALREADY_FUSED, notes=_notes(module))
        reason = overridden(module, family) or family.refusal(module)
        return AttentionLayer(path, _qualname(module), heads, embed, SKIPPED if reason else WILL_ROUTE,
                              reason=reason, notes=[] if reason else _notes(module))

    def notes(self, sites: List[Site], applied: bool) -> List[str]:
        return routing_note(sites, applied, lambda verb: (
            f"Bloom/MPT attention modules {verb} on the fused operator, causal with the key padding of the "
            "model's causal mask and the model's ALiBi as per-head slopes (alibi_slopes); calls the operator "
            "cannot reproduce run the stock module (attn_export.surgery.fused_calls(module) counts both)"))

    def apply(self, model: nn.Module, sites: List[Site]):
        done = []
        for site in sites:
            if site.layer.status != WILL_ROUTE:
                continue
            module = site.module
            family = family_of(module)
            done.append((site.layer.path, {"forward": module.__dict__.get("forward", MISSING)}))
            module.forward = AlibiForward(module, family, family.slopes(module))
            site.layer.status = ROUTED
        return [], done

    def undo(self, model: nn.Module, applied) -> None:
        for path, saved in applied:
            restore_attributes(model.get_submodule(path), saved)

    def calls(self, module: nn.Module) -> Optional[CallCount]:
        forward = _routed(module)
        return None if forward is None else CallCount.from_counter(forward.calls)

    def unconfirmed(self, module: nn.Module) -> Optional[str]:
        count = self.calls(module) or CallCount()
        if count.unfused:
            return "its calls ran the stock module: " + "; ".join(sorted(count.unfused))
        if not count.fused:
            return "its forward was not called when the model ran"
        return None


def _notes(module: nn.Module) -> List[str]:
    family = family_of(module)
    slopes = ", ".join(f"{s:g}" for s in family.slopes(module))
    return [f"ALiBi as the operator's slopes [{slopes}]; unfused in training with attention dropout, and when "
            "attention weights are asked for"]
