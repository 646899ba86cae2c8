"""The diffusers route: an attention module of a diffusers model (``attn.processor``) gets a
processor of its own kind whose SDPA calls run on the operator (:mod:`attn_export.surgery.diffusers`),
set through diffusers' own ``set_processor``; the module's ``forward`` is left alone.

Sites are the modules with a diffusers processor in which a sample forward saw SDPA calls (or,
without one, whose processor's ``__call__`` names SDPA), reported as the SDPA route reports them
(``found="sdpa"``, the same statuses, reasons and notes). Processors that are modules (they hold
weights, e.g. IP-adapter ones) are left to the SDPA route. Undo sets the original processor
back; the calls are counted on the fused processor.
"""
from __future__ import annotations

from typing import List, Optional

from torch import nn

from attn_export.surgery.diffusers import fused_processor, is_fused_processor
from attn_export.surgery.routes.base import CallCount, Route, Scan, Site
from attn_export.surgery.routes.sdpa import sdpa_note, sdpa_site
from attn_export.surgery.sdpa.source import _calls_sdpa
from attn_export.surgery.site_report import ROUTED, WILL_ROUTE, AttentionLayer


def processor_of(module: nn.Module):
    """The processor object of a diffusers attention module (None for anything else)."""
    if not (type(module).__module__ or "").startswith("diffusers.") or not hasattr(module, "set_processor"):
        return None
    processor = module.__dict__.get("processor")
    return None if processor is None or isinstance(processor, nn.Module) else processor


class DiffusersProcessors(Route):
    name = "diffusers"
    descend = True  # as the SDPA route: a site inside a site is its own

    def claim(self, scan: Scan, module: nn.Module, parent: Optional[nn.Module], path: str) -> Optional[AttentionLayer]:
        processor = processor_of(module)
        if processor is None:
            return None
        cls = type(processor)
        return sdpa_site(scan, module, path, lambda: _calls_sdpa(cls.__call__, cls, 2, set()),
                         is_fused_processor(processor))

    def notes(self, sites: List[Site], applied: bool) -> List[str]:
        return sdpa_note(sites, applied)

    def apply(self, model: nn.Module, sites: List[Site]):
        replaced = []
        for site in sites:
            if site.layer.status == WILL_ROUTE:
                original = site.module.processor
                site.module.set_processor(fused_processor(original))
                site.layer.status = ROUTED
                replaced.append((site.layer.path, original))
        return [], replaced

    def undo(self, model: nn.Module, applied) -> None:
        for path, original in applied:
            model.get_submodule(path).set_processor(original)

    def calls(self, module: nn.Module) -> Optional[CallCount]:
        processor = processor_of(module)
        if processor is None or not is_fused_processor(processor):
            return None
        return CallCount.from_counter(getattr(processor, "calls", {}))
