"""Deprecated: the SDPA route lives in :mod:`attn_export.surgery.routes.sdpa` (the route) and
:mod:`attn_export.surgery.sdpa` (its parts). Every name this module had still resolves, with a
DeprecationWarning that says where it lives now; ``calls(module)`` is
``attn_export.surgery.fused_calls(module).as_counter()``."""
from __future__ import annotations

import importlib
import warnings

from attn_export.surgery.routes import fused_calls

_PARTS = {
    "intercept": ["RoutedForward", "SdpaMode", "_rebuild", "_state", "call_counter", "is_routed", "route_module",
                  "routing", "unroute_module"],
    "observe": ["ObservedSite", "_ObserveMode", "observe_calls"],
    "source": ["SDPA_NAME", "_cache", "_calls_sdpa", "_class_attr", "_code_names", "_function", "calls_sdpa", "sites"],
    "translate": ["SUPPORTED_DTYPES", "_agree", "_device_supported", "_exporting", "_operator_masks",
                  "_sdpa_arguments", "explain_refusal", "is_one", "known_equal", "repeat_heads", "sdpa_via_operator"],
}
_MOVED = {name: f"attn_export.surgery.sdpa.{part}" for part, names in _PARTS.items() for name in names}


def _calls(module):
    """The SDPA calls a routed module has made: ``{"fused": n, "stock: <reason>": m}``."""
    return fused_calls(module).as_counter()


def __getattr__(name):
    if name == "calls":
        warnings.warn("attn_export.surgery.sdpa_route.calls(module) is deprecated: use "
                      "attn_export.surgery.fused_calls(module).as_counter()", DeprecationWarning, stacklevel=2)
        return _calls
    if name in _MOVED:
        warnings.warn(f"attn_export.surgery.sdpa_route.{name} is deprecated: use {_MOVED[name]}.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'attn_export.surgery.sdpa_route' has no attribute {name!r}")
