"""SDPA sites found by reading source: whether a module's ``forward`` names
``scaled_dot_product_attention``, itself or through helper functions and methods of its class two
calls deep. A hint for when no sample forward runs; it misses calls through processors, dispatch
functions and stored callables (:mod:`attn_export.surgery.sdpa.observe` finds those)."""
from __future__ import annotations

import types
from typing import Dict, List, Optional, Tuple

from torch import nn

SDPA_NAME = "scaled_dot_product_attention"


def _code_names(code: types.CodeType) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, comprehensions, lambdas
            names |= _code_names(const)
    return names


def _function(obj):
    obj = getattr(obj, "__func__", obj)  # bound/static methods
    return obj if isinstance(obj, types.FunctionType) else None


def _calls_sdpa(fn, owner: Optional[type], depth: int, seen: set) -> bool:
    fn = _function(fn)
    if fn is None or fn in seen:
        return False
    seen.add(fn)
    module = getattr(fn, "__module__", "") or ""
    if module.startswith("torch.") or module == "torch":
        return False  # torch's own functions (F.multi_head_attention_forward ...) are not user sites
    names = _code_names(fn.__code__)
    if SDPA_NAME in names:
        return True
    if depth <= 0:
        return False
    for name in names:
        target = fn.__globals__.get(name)
        if target is None and owner is not None:
            target = owner.__dict__.get(name) if name in owner.__dict__ else _class_attr(owner, name)
        if target is not None and _calls_sdpa(target, owner, depth - 1, seen):
            return True
    return False


def _class_attr(owner: type, name: str):
    for klass in owner.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


_cache: Dict[type, bool] = {}


def calls_sdpa(module: nn.Module) -> bool:
    """Whether ``type(module).forward`` calls ``scaled_dot_product_attention`` itself or through
    a helper function or a method of its class (up to two calls deep). torch.nn's own modules
    (``nn.MultiheadAttention`` ...) are not SDPA sites."""
    cls = type(module)
    if cls not in _cache:
        forward = cls.forward
        _cache[cls] = (not (cls.__module__ or "").startswith("torch.")) and _calls_sdpa(forward, cls, 2, set())
    return _cache[cls]


def sites(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of every module of ``model`` whose forward calls SDPA (first path only)."""
    found, seen = [], set()
    for path, module in model.named_modules():
        if id(module) not in seen and calls_sdpa(module):
            seen.add(id(module))
            found.append((path, module))
    return found
