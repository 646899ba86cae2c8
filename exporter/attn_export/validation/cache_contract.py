"""Deprecated: the cache's contract is attn_export.cache_contract.CacheContract (its names and
axes), and its graph check attn_export.validation.checks.cache_contract_check."""
from __future__ import annotations

from attn_export._moved import moved


def _contract_names(num_layers: int, position_ids: bool):
    from attn_export.cache_contract import CacheContract

    contract = CacheContract(num_layers, 1, 1, position_ids)
    return contract.input_names(), contract.output_names()


def _declared_axes(layout):
    return layout.dynamic_axes()


def _check():
    from attn_export.validation.checks import cache_contract_check

    return cache_contract_check


_MOVED = {"contract_names": ("attn_export.cache_contract.CacheContract.input_names / output_names",
                             lambda: _contract_names),
          "declared_axes": ("attn_export.cache_contract.CacheContract.dynamic_axes", lambda: _declared_axes),
          "cache_contract_check": ("attn_export.validation.checks.cache_contract_check", _check)}


__getattr__ = moved(__name__, _MOVED)
