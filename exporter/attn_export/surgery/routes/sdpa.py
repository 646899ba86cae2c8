"""The SDPA route: modules in which ``F.scaled_dot_product_attention`` calls run get an instance
``forward`` that runs their calls on the operator. The machinery is :mod:`attn_export.surgery.sdpa`
(finding the calls, translating one, intercepting them); this module is the route that uses it.

Sites are the modules a sample forward saw calling SDPA (the innermost module running at each
call), or without one those whose source calls it. A site whose every observed call is one the
operator cannot express is skipped with the reasons. torch.nn's own modules and the fused module
are never sites (the module route has them). Undo removes the instance ``forward`` (putting back
one the module had before); the calls are counted on it, and a site that made no fused call when
the routed model ran is reported as skipped (:meth:`SdpaCalls.unconfirmed`).

The diffusers route (:mod:`attn_export.surgery.routes.diffusers`) is an :class:`SdpaSites` route
too: its processors' calls are SDPA calls, reported, noted and confirmed alike.
"""
from __future__ import annotations

from typing import Callable, List, Optional

from torch import nn

from attn_export.ops.module import FusedMultiheadAttention, StockMultiheadAttention
from attn_export.surgery.geometry import geometry
from attn_export.surgery.routes.base import MISSING, CallCount, Route, Scan, Site, restore_attributes, routing_note
from attn_export.surgery.sdpa.intercept import call_counter, is_routed, route_module
from attn_export.surgery.sdpa.source import calls_sdpa
from attn_export.surgery.site_report import ALREADY_FUSED, ROUTED, SKIPPED, WILL_ROUTE, AttentionLayer, _qualname

UNOBSERVED_NOTE = ("no sample forward ran, so F.scaled_dot_product_attention calls were looked for in the modules' "
                   "source, which misses calls through processors, dispatch functions and stored callables: pass "
                   "example inputs")


def sdpa_notes(module: nn.Module) -> List[str]:
    """The note on a site's attention dropout, under the names the models in the wild use."""
    for name in ("attn_drop", "attn_dropout", "attention_dropout", "dropout", "dropout_p", "attn_pdrop"):
        value = getattr(module, name, None)
        value = value.p if isinstance(value, nn.Dropout) else value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return [f"{name}={value}: calls with dropout_p > 0 (training) run on PyTorch's SDPA (dropout is not "
                    "fused); fused otherwise"]
    return []


def sdpa_layer(module: nn.Module, path: str, seen, routed: bool) -> AttentionLayer:
    """A module in which SDPA calls run: to be routed, unless every call it made in the sample
    forward (``seen``, an ObservedSite) is one the operator cannot express. Heads and embed dim
    from its calls where the module does not name them."""
    heads, embed = geometry(module)
    if seen is not None and seen.heads is not None:
        heads = heads if heads is not None else seen.heads
        embed = embed if embed is not None else seen.heads * seen.head_dim
    if routed:
        status, reason = ALREADY_FUSED, None
    elif seen is not None and seen.refusals:
        status = SKIPPED
        reason = "its F.scaled_dot_product_attention call(s) would run on PyTorch's SDPA: " + "; ".join(seen.refusals)
    else:
        status, reason = WILL_ROUTE, None
    return AttentionLayer(path, _qualname(module), heads, embed, status, reason=reason,
                          notes=sdpa_notes(module) if status != SKIPPED else [])


def sdpa_site(scan: Scan, module: nn.Module, path: str, calls_in_source: Callable[[], bool],
              routed: bool) -> Optional[AttentionLayer]:
    """The row of a module in which SDPA calls run (seen by the sample forward, or without one,
    where ``calls_in_source()`` says so), else None."""
    if scan.observed is None:
        return sdpa_layer(module, path, None, routed) if calls_in_source() else None
    seen = scan.observed.get(id(module))
    return None if seen is None else sdpa_layer(module, path, seen, routed)


def sdpa_note(route: str, sites: List[Site], applied: bool) -> List[str]:
    """The report's note on the SDPA calls of ``route``'s sites routed (or to be routed)."""
    return routing_note(sites, applied, lambda verb: (
        f"F.scaled_dot_product_attention calls of the '{route}' sites {verb} on the fused operator; calls it "
        "cannot express (dropout_p > 0, a mask that requires grad, ...) stay on PyTorch's SDPA "
        "(attn_export.surgery.fused_calls(module) counts both)"))


def unconfirmed_calls(count: Optional[CallCount]) -> Optional[str]:
    """Why a site whose SDPA calls were routed did not run on the operator when the model ran:
    some of its calls ran on PyTorch's SDPA, or it made none; None when every call was fused."""
    count = count or CallCount()
    stock = sorted(count.unfused)
    if stock:
        return "its F.scaled_dot_product_attention call(s) ran on PyTorch's SDPA: " + "; ".join(stock)
    if not count.fused:
        return ("its forward made no F.scaled_dot_product_attention call when the model ran (it took another path, "
                "e.g. a switch such as timm's fused_attn=False)")
    return None


class SdpaSites(Route):
    """A route whose sites are modules in which SDPA calls run: its notes, the check after the run,
    and ``apply`` (``route_site`` per site to route, which returns what undo needs) are shared."""

    descend = True  # attention inside attention (a block calling SDPA around an inner site) is its own site
    unobserved_note = UNOBSERVED_NOTE  # found by reading source without a sample forward

    def route_site(self, module: nn.Module):
        """Runs the SDPA calls of the site ``module`` on the operator; returns what undo needs."""
        raise NotImplementedError

    def notes(self, sites: List[Site], applied: bool) -> List[str]:
        return sdpa_note(self.name, sites, applied)

    def apply(self, model: nn.Module, sites: List[Site]):
        done = []
        for site in sites:
            if site.layer.status == WILL_ROUTE:
                done.append((site.layer.path, self.route_site(site.module)))
                site.layer.status = ROUTED
        return [], done

    def unconfirmed(self, module: nn.Module) -> Optional[str]:
        return unconfirmed_calls(self.calls(module))


class SdpaCalls(SdpaSites):
    name = "sdpa"

    def claim(self, scan: Scan, module: nn.Module, parent: Optional[nn.Module], path: str) -> Optional[AttentionLayer]:
        if isinstance(module, (StockMultiheadAttention, FusedMultiheadAttention)):
            return None
        return sdpa_site(scan, module, path, lambda: calls_sdpa(module), is_routed(module))

    def decline(self, scan: Scan, module: nn.Module) -> Optional[str]:
        if scan.observed is not None and calls_sdpa(module):
            return ("its source calls F.scaled_dot_product_attention, but the sample forward made no such call in it "
                    "(it took another path, e.g. a switch such as timm's fused_attn=False)")
        return None

    def missing(self, scan: Scan) -> Optional[str]:
        if scan.observed is not None:
            return "no F.scaled_dot_product_attention call ran in it in the sample forward"
        return "its forward calls no F.scaled_dot_product_attention"

    def route_site(self, module: nn.Module):
        saved = {"forward": module.__dict__.get("forward", MISSING)}
        route_module(module)
        return saved

    def undo(self, model: nn.Module, applied) -> None:
        for path, saved in applied:
            restore_attributes(model.get_submodule(path), saved)

    def calls(self, module: nn.Module) -> Optional[CallCount]:
        counter = call_counter(module)
        return None if counter is None else CallCount.from_counter(counter)
