"""What model surgery found and did, site by site: the statuses, one row per attention site
(``AttentionLayer``), and the report that ``inspect_attention`` / ``replace_attention`` return
(``ReplacementReport``: table, JSON, coverage gate). exporter/attn_export/surgery/replace.py fills it."""
from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from torch import nn

REPLACED = "replaced"  # the module route: the module swapped for the fused one
WILL_REPLACE = "will be replaced"
# every other route: the module stays, its attention calls reach the operator
ROUTED = "routed"
WILL_ROUTE = "will be routed"
ALREADY_FUSED = "already fused"
SKIPPED = "skipped"
# hand-written attention rewritten to the operator in the captured graph (export only)
REWRITTEN = "rewritten in the export"
_CHANGED = (REPLACED, WILL_REPLACE, ROUTED, WILL_ROUTE, REWRITTEN)


class CoverageError(RuntimeError):
    """Fewer attention layers would be replaced than the caller required."""


def _qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class AttentionLayer:
    """One attention layer of a model and what replace_attention does (or did) with it."""

    path: str
    cls: str
    num_heads: Optional[int]
    embed_dim: Optional[int]
    status: str
    reason: Optional[str] = None
    notes: List[str] = field(default_factory=list)
    also_at: List[str] = field(default_factory=list)  # the same module reached by other paths
    # how the site was found: the name of the route that reached it (attn_export.surgery.routes:
    # "transformers", "alibi", "diffusers", "sdpa", "module"), "pattern" (hand-written attention
    # rewritten in the export), "" (an unrecognized module named like an attention layer)
    found: str = "module"


@dataclass
class ReplacementReport:
    layers: List[AttentionLayer]
    notes: List[str] = field(default_factory=list)
    applied: bool = True  # False for inspect_attention (nothing changed)
    # what replace_attention did, for restore_attention (routes.undo.Surgery); None for a plan
    surgery: Optional[Any] = field(default=None, repr=False, compare=False)

    @property
    def replaced(self) -> List[AttentionLayer]:
        """Layers replaced (or routed) now; planned ones for inspect_attention."""
        return [layer for layer in self.layers if layer.status in _CHANGED]

    @property
    def skipped(self) -> List[AttentionLayer]:
        return [layer for layer in self.layers if layer.status == SKIPPED]

    @property
    def already_fused(self) -> List[AttentionLayer]:
        return [layer for layer in self.layers if layer.status == ALREADY_FUSED]

    @property
    def num_replaced(self) -> int:
        return len(self.replaced)

    @property
    def num_fused(self) -> int:
        """Layers that run the fused operator afterwards (replaced now or fused before)."""
        return len(self.replaced) + len(self.already_fused)

    def coverage_error(self, min_replaced: Optional[int] = None, require_all: bool = False) -> Optional[str]:
        """None when the coverage requirement holds, else the reason in one sentence."""
        if require_all and self.skipped:
            listed = "; ".join(f"{layer.path}: {layer.reason}" for layer in self.skipped)
            return f"{len(self.skipped)} attention layer(s) cannot be fused ({listed})"
        if min_replaced is not None and self.num_fused < min_replaced:
            return (
                f"only {self.num_fused} attention layer(s) fused, fewer than the required {min_replaced} "
                f"({len(self.layers)} found, {len(self.skipped)} skipped)"
            )
        return None

    def confirm_calls(self, model: nn.Module) -> List[str]:
        """After ``model`` (the one :func:`replace_attention` changed) has run: every routed site
        that its route says did not run on the operator (an ``sdpa`` site that made no SDPA call,
        or whose calls ran on PyTorch's SDPA) becomes skipped with the reason. Returns one line per
        site changed (none for a plan, which changed nothing)."""
        return self.surgery.confirm(model, self.layers) if self.surgery is not None else []

    confirm_sdpa_calls = confirm_calls  # its earlier name, when only the SDPA routes confirmed

    def add_pattern_sites(self, sites, model: Optional[nn.Module] = None) -> None:
        """Records the hand-written attention found in a captured graph
        (attn_export.surgery.patterns.PatternSite rows), one row per module: rewritten when
        every match in it was, else skipped with the first reason. A match is owned by the
        attention module around it: the nearest enclosing module the report lists, else (with
        ``model``) the nearest one that is not one of torch.nn's own (an ``nn.Softmax`` child
        named ``attend`` is not the site)."""
        by_path = {layer.path: layer for layer in self.layers}
        grouped: Dict[str, list] = {}
        for site in sites:
            grouped.setdefault(_owner(site.path, by_path, model), []).append(site)
        for path, group in grouped.items():
            layer = by_path.get(path)
            if layer is not None and layer.found not in ("", "pattern") and layer.status != SKIPPED:
                continue  # a softmax inside a site fused otherwise: reported there
            if layer is None:
                cls = _qualname(model.get_submodule(path)) if model is not None and path != group[0].path \
                    else group[0].cls
                layer = AttentionLayer(path, cls, None, None, SKIPPED)
                self.layers.append(layer)
                by_path[path] = layer
            refused = [site.reason for site in group if not site.rewritten]
            heads = next((site.heads for site in group if getattr(site, "heads", None)), None)
            head_dim = next((site.head_dim for site in group if getattr(site, "head_dim", None)), None)
            if layer.num_heads is None:
                layer.num_heads = heads
            if layer.embed_dim is None and layer.num_heads and head_dim:
                layer.embed_dim = layer.num_heads * head_dim
            layer.found = "pattern"
            layer.status = SKIPPED if refused else REWRITTEN
            layer.reason = f"hand-written attention not rewritten: {refused[0]}" if refused else None
            layer.notes = []

    def to_dict(self) -> Dict:
        return {
            "applied": self.applied,
            "num_found": len(self.layers),
            "num_replaced": self.num_replaced,  # swapped modules and routed transformers layers
            "num_routed": sum(1 for layer in self.layers if layer.status in (ROUTED, WILL_ROUTE)),
            "num_by_found": dict(collections.Counter(layer.found for layer in self.layers)),
            "num_already_fused": len(self.already_fused),
            "num_skipped": len(self.skipped),
            "layers": [asdict(layer) for layer in self.layers],
            "notes": list(self.notes),
        }

    def table(self, title: Optional[str] = None):
        """A rich Table: one row per layer."""
        from rich.table import Table

        table = Table(title=title or f"Attention layers: {self.summary()}")
        for column in ("module path", "class", "found", "heads", "embed dim", "status", "reason / notes"):
            table.add_column(column, justify="right" if column in ("heads", "embed dim") else "left",
                             overflow="fold", no_wrap=column in ("found", "heads", "embed dim", "status"))
        styles = {REPLACED: "green", WILL_REPLACE: "green", ROUTED: "green", WILL_ROUTE: "green", REWRITTEN: "green",
                  ALREADY_FUSED: "cyan", SKIPPED: "yellow"}
        for layer in self.layers:
            detail = "; ".join(([layer.reason] if layer.reason else []) + layer.notes)
            if layer.also_at:
                detail = "; ".join(filter(None, [detail, "also at " + ", ".join(layer.also_at)]))
            table.add_row(
                layer.path or "(model)",
                _short_class(layer.cls),
                layer.found or "-",
                "-" if layer.num_heads is None else str(layer.num_heads),
                "-" if layer.embed_dim is None else str(layer.embed_dim),
                f"[{styles.get(layer.status, '')}]{layer.status}[/]",
                detail,
            )
        return table

    def summary(self) -> str:
        routed = sum(1 for layer in self.layers if layer.status in (ROUTED, WILL_ROUTE))
        rewritten = sum(1 for layer in self.layers if layer.status == REWRITTEN)
        swapped = self.num_replaced - routed - rewritten
        parts = [f"{len(self.layers)} found"]
        if swapped or not (routed or rewritten):
            parts.append(f"{swapped} {'replaced' if self.applied else 'to replace'}")
        if routed:
            parts.append(f"{routed} {'routed' if self.applied else 'to route'}")
        if rewritten:
            parts.append(f"{rewritten} rewritten in the export")
        if self.already_fused:
            parts.append(f"{len(self.already_fused)} already fused")
        parts.append(f"{len(self.skipped)} skipped")
        return ", ".join(parts)

    def __str__(self) -> str:
        lines = [f"attention layers: {self.summary()}"]
        for layer in self.layers:
            extra = f" ({layer.reason})" if layer.reason else ""
            how = f" [{layer.found}]" if layer.found else ""
            lines.append(f"  {layer.path or '(model)'}: {layer.cls}{how}, {layer.status}{extra}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _owner(path: str, listed: Dict[str, AttentionLayer], model: Optional[nn.Module]) -> str:
    """The module that owns a match found in the forward of the module at ``path``."""
    candidates = [path]
    while candidates[-1]:
        candidates.append(candidates[-1].rpartition(".")[0])
    for candidate in candidates:
        if candidate in listed:
            return candidate
    if model is None:
        return path
    for candidate in candidates:
        try:
            module = model.get_submodule(candidate)
        except AttributeError:
            return path
        if not (type(module).__module__ or "").startswith("torch.nn."):
            return candidate
    return path


def _short_class(qualified: str) -> str:
    for prefix, short in (("torch.nn.modules.", "nn."), ("attn_export.ops.module.", "attn_export."),
                          ("transformers.models.", "transformers.")):
        if qualified.startswith(prefix):
            return short + qualified.rpartition(".")[2]
    return qualified
