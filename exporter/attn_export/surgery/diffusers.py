"""Deprecated: diffusers' fused processors live in their route,
:mod:`attn_export.surgery.routes.diffusers`. Every name this module had still resolves, with a
DeprecationWarning that says so."""
from __future__ import annotations

import warnings

from attn_export.surgery.routes import diffusers as _route

_MOVED = {"is_fused_processor", "fused_processor_class", "fused_processor", "use_fused_processors",
          "processor_calls"}


def __getattr__(name):
    if name in _MOVED:
        warnings.warn(f"attn_export.surgery.diffusers.{name} is deprecated: use "
                      f"attn_export.surgery.routes.diffusers.{name}", DeprecationWarning, stacklevel=2)
        return getattr(_route, name)
    raise AttributeError(f"module 'attn_export.surgery.diffusers' has no attribute {name!r}")
