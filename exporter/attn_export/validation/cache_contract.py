"""Deprecated: the cache's contract is attn_export.cache_contract.CacheContract (its names and
axes), and its graph check attn_export.validation.checks.cache_contract_check."""
from __future__ import annotations

import warnings


def _contract_names(num_layers: int, position_ids: bool):
    from attn_export.cache_contract import CacheContract

    contract = CacheContract(num_layers, 1, 1, position_ids)
    return contract.input_names(), contract.output_names()


def _declared_axes(layout):
    return layout.dynamic_axes()


def _check():
    from attn_export.validation.checks import cache_contract_check

    return cache_contract_check


_MOVED = {"contract_names": ("CacheContract.input_names / output_names", lambda: _contract_names),
          "declared_axes": ("CacheContract.dynamic_axes", lambda: _declared_axes),
          "cache_contract_check": ("attn_export.validation.checks.cache_contract_check", _check)}


def __getattr__(name: str):
    if name in _MOVED:
        where, value = _MOVED[name]
        warnings.warn(f"{__name__}.{name} is deprecated: use {where}", DeprecationWarning, stacklevel=2)
        return value()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
