"""The transformers route: attention layers of Hugging Face models that dispatch through
transformers' ``AttentionInterface`` are routed by setting the model's ``attn_implementation``
to ``"attn_export"`` (:mod:`attn_export.surgery.transformers`), then checked one by one. The
modules stay in place. Undo puts every config of the model back as it was (transformers keeps
the implementation in the configs) and removes the call counts the layers gathered.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from torch import nn

from attn_export.surgery import transformers as _hf
from attn_export.surgery.routes.base import CallCount, Route, Scan, Site, restore_attributes, saved_attributes
from attn_export.surgery.site_report import ALREADY_FUSED, ROUTED, SKIPPED, WILL_ROUTE, AttentionLayer, _qualname
from attn_export.surgery.transformers.interface import COUNTS


def routing_note(sites: List[Site], applied: bool) -> List[str]:
    if not any(site.layer.status in (ROUTED, WILL_ROUTE) for site in sites):
        return []
    verb = "are routed" if applied else "will be routed"
    return [f"transformers attention layers {verb} through transformers' AttentionInterface "
            f"(attn_implementation='{_hf.IMPLEMENTATION}'); the modules themselves stay in place"]


def _not_set(module: nn.Module, refusals: List[str]) -> str:
    config = _hf.module_config(module)
    now = None if config is None else config._attn_implementation
    return (f"transformers did not set attn_implementation='{_hf.IMPLEMENTATION}' on it (it stays "
            f"{now!r}; the model class may not support changing it after loading: load it with "
            f"attn_implementation='{_hf.IMPLEMENTATION}')" + (f"; {'; '.join(refusals)}" if refusals else ""))


def _configs(model: nn.Module) -> List:
    """Every config object of the model's modules and their sub-configs, once each."""
    found: Dict[int, object] = {}
    pending = [m.config for m in model.modules() if _hf.module_config(m) is not None]
    while pending:
        config = pending.pop()
        if id(config) in found:
            continue
        found[id(config)] = config
        pending.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})
        pending = [c for c in pending if c is not None]
    return list(found.values())


def _copied(saved: Dict) -> Dict:
    return {name: dict(value) if isinstance(value, dict) else value for name, value in saved.items()}


class TransformersLayers(Route):
    name = "transformers"
    by_type = True

    def claim(self, scan: Scan, module: nn.Module, parent: Optional[nn.Module], path: str) -> Optional[AttentionLayer]:
        if not scan.once("contains_hf_model", lambda: _hf.contains_hf_model(scan.model)):
            return None
        classified = _hf.classify(module)
        if classified is None:
            return None
        state, reason, notes = classified
        heads, embed = _hf.layer_geometry(module)
        status = {"routed": ALREADY_FUSED, "routable": WILL_ROUTE}.get(state, SKIPPED)
        return AttentionLayer(path, _qualname(module), heads, embed, status, reason=reason,
                              notes=notes if status != SKIPPED else [])

    def decline(self, scan: Scan, module: nn.Module) -> Optional[str]:
        if scan.once("contains_hf_model", lambda: _hf.contains_hf_model(scan.model)):
            return ("does not dispatch through transformers' AttentionInterface (it computes attention itself), so "
                    "attn_implementation cannot route it")
        return None

    def notes(self, sites: List[Site], applied: bool) -> List[str]:
        return routing_note(sites, applied)

    def apply(self, model: nn.Module, sites: List[Site]):
        pending = [site for site in sites if site.layer.status == WILL_ROUTE]
        if not pending:
            return [], None
        configs = [(config, dict(vars(config))) for config in _configs(model)]
        refusals = _hf.route(model)
        for site in pending:
            config = _hf.module_config(site.module)
            if config is not None and config._attn_implementation == _hf.IMPLEMENTATION:
                site.layer.status = ROUTED
            else:
                site.layer.status, site.layer.notes = SKIPPED, []
                site.layer.reason = _not_set(site.module, refusals)
        counts = [(site.layer.path, _copied(saved_attributes(site.module, COUNTS))) for site in pending]
        return [], (configs, counts)

    def undo(self, model: nn.Module, applied) -> None:
        if applied is None:
            return
        configs, counts = applied
        for config, saved in configs:
            vars(config).clear()
            vars(config).update(saved)
        for path, saved in counts:  # the calls its layers counted since
            restore_attributes(model.get_submodule(path), saved)

    def calls(self, module: nn.Module) -> Optional[CallCount]:
        fused, unfused = (module.__dict__.get(name) for name in COUNTS)
        if fused is None and unfused is None:
            return None
        return CallCount(fused or 0, dict(unfused or {}))
