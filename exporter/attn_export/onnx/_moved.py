"""Names a module used to carry only because it imported them: still importable from there,
with a DeprecationWarning that names their home."""
from __future__ import annotations

import importlib
import warnings
from typing import Callable, Mapping


def moved_names(module: str, homes: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``module``: ``homes`` maps each old name to the module that
    holds it now."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is deprecated: import it from {home}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)

    return __getattr__
