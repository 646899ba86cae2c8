"""The route protocol: one way an attention site of a model is reached and run on the fused
operator. :func:`attn_export.replace_attention` walks the model and, at each module, asks the
routes of the registry (:data:`attn_export.surgery.routes.ROUTES`) in order whether the module is
one of their sites; the first that claims it owns it. A route then applies itself to its sites,
undoes what it applied, and counts the calls that ran at a site.

A route's ``apply`` returns its notes and what ``undo`` needs (any object): undo puts back
exactly what apply changed, the same objects in the same places, and removes what it added. It
finds modules by path: the model's structure is the one apply left.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from torch import nn

from attn_export.surgery.site_report import AttentionLayer

Place = Tuple[str, Optional[nn.Module], str]  # (path, parent, attribute name in the parent)


@dataclass(frozen=True)
class CallCount:
    """What ran at one site since it was routed: ``fused`` calls on the operator, and the calls
    that ran the library's own attention instead, by reason (``unfused``)."""

    fused: int = 0
    unfused: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: "CallCount") -> "CallCount":
        unfused = collections.Counter(self.unfused)
        unfused.update(other.unfused)
        return CallCount(self.fused + other.fused, dict(unfused))

    @classmethod
    def from_counter(cls, counter: Mapping[str, int]) -> "CallCount":
        """From SDPA's counter keys: ``"fused"`` and ``"stock: <reason>"``."""
        return cls(counter.get("fused", 0),
                   {key[len("stock: "):]: n for key, n in counter.items() if key.startswith("stock: ")})

    def as_counter(self) -> Dict[str, int]:
        """In SDPA's counter keys (``{"fused": n, "stock: <reason>": m}``, zero counts left out)."""
        counts = {"fused": self.fused} if self.fused else {}
        counts.update({f"stock: {reason}": n for reason, n in self.unfused.items()})
        return counts


@dataclass
class Scan:
    """What every route may read while finding sites: the model, and the SDPA calls a sample
    forward saw per module id (None when no sample forward ran). ``once`` keeps a fact about the
    model that a route computes once per scan."""

    model: nn.Module
    observed: Optional[Dict[int, Any]] = None
    _facts: Dict[str, Any] = field(default_factory=dict)

    def once(self, name: str, compute: Callable[[], Any]) -> Any:
        if name not in self._facts:
            self._facts[name] = compute()
        return self._facts[name]


@dataclass
class Site:
    """One site a route claimed: its report row, the module, and every place it sits (a module
    reached by several paths is one site)."""

    layer: AttentionLayer
    module: nn.Module
    places: List[Place]
    route: "Route"


class Route:
    """One way attention sites are reached. Subclasses set ``name`` and override ``claim``; the
    other methods default to "nothing to do". Everything the report says about a route's sites
    comes from here: the rows' ``found`` is the route's ``name``."""

    name = ""
    descend = False  # whether the modules inside a claimed site are visited too
    # True where sites are recognized by their class, so that a sample forward finds no more
    by_type = False
    # The report's note when no sample forward ran and this route may have missed sites
    unobserved_note: Optional[str] = None

    def claim(self, scan: Scan, module: nn.Module, parent: Optional[nn.Module], path: str) -> Optional[AttentionLayer]:
        """The report row of ``module`` if it is a site of this route (its status ``will be ...``,
        ``already fused`` or ``skipped`` with the reason), else None. The walk sets the row's
        ``found`` to :attr:`name`."""
        raise NotImplementedError

    def decline(self, scan: Scan, module: nn.Module) -> Optional[str]:
        """Why a module named like an attention layer that no route claimed cannot be reached by
        this route, where this route has the most specific reason; None otherwise."""
        return None

    def missing(self, scan: Scan) -> Optional[str]:
        """What a module no route claimed lacks to be a site of this route, as a clause of the
        report's general reason ("it is not a torch.nn.MultiheadAttention"); None to say nothing."""
        return None

    def unconfirmed(self, module: nn.Module) -> Optional[str]:
        """After the routed model ran: why this route's site ``module`` did not run on the
        operator (the report marks it skipped with this reason); None where it did, or where the
        route's sites need no confirming."""
        return None

    def notes(self, sites: List[Site], applied: bool) -> List[str]:
        """Report notes about this route's sites, planned (``applied=False``) or done."""
        return []

    def apply(self, model: nn.Module, sites: List[Site]) -> Tuple[List[str], Any]:
        """Applies the route to its sites whose status is ``will be ...`` and sets each one's
        status to what happened; returns notes on what else it changed, and what :meth:`undo`
        needs."""
        return [], None

    def undo(self, model: nn.Module, applied: Any) -> None:
        """Puts back exactly what :meth:`apply` changed (its return value is ``applied``)."""

    def calls(self, module: nn.Module) -> Optional[CallCount]:
        """The calls that ran at ``module`` if it is a routed site of this route that counts them."""
        return None


def routing_note(sites: List[Site], applied: bool, note: Callable[[str], str]) -> List[str]:
    """A route's report note, ``note("run")`` once it is applied (``note("will run")`` before), or
    none where no site of the route is routed."""
    from attn_export.surgery.site_report import ROUTED, WILL_ROUTE

    if not any(site.layer.status in (ROUTED, WILL_ROUTE) for site in sites):
        return []
    return [note("run" if applied else "will run")]


def restore_attributes(obj: Any, saved: Mapping[str, Any]) -> None:
    """Sets each instance attribute of ``obj`` named in ``saved`` back to its value, deleting those
    saved as :data:`MISSING` (attributes that did not exist)."""
    for name, value in saved.items():
        if value is MISSING:
            obj.__dict__.pop(name, None)
        else:
            obj.__dict__[name] = value


def saved_attributes(obj: Any, names: Iterable[str]) -> Dict[str, Any]:
    """The instance attributes ``names`` of ``obj`` (:data:`MISSING` for those it does not have)."""
    return {name: obj.__dict__.get(name, MISSING) for name in names}


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()
