"""Deprecation aliases for names that moved to another module: the old module keeps them
importable, with a DeprecationWarning that says where they live now.

    __getattr__ = moved(__name__, {"OLD_NAME": ("attn_export.new_module.NEW_NAME", lambda: NEW_NAME)})
"""
from __future__ import annotations

import warnings
from typing import Callable, Mapping, Tuple


def moved(module: str, names: Mapping[str, Tuple[str, Callable[[], object]]]) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``module`` that answers each of ``names`` (old name ->
    (where it lives now, a function returning its value)) with a warning, and any other name
    with AttributeError."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        where, value = names[name]
        warnings.warn(f"{module}.{name} is deprecated: use {where}", DeprecationWarning, stacklevel=2)
        return value()

    return __getattr__
