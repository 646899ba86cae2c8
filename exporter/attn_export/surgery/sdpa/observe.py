"""SDPA sites found by running the model: a sample forward attributes every
``F.scaled_dot_product_attention`` call to the innermost module on the call stack, however the
call is reached (a processor object, a dispatch function, a closure, a callable stored on the
instance), and checks each call as the route would."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attn_export.surgery.sdpa.translate import _sdpa_arguments, explain_refusal


@dataclass
class ObservedSite:
    """The SDPA calls one module made in a sample forward: ``calls`` counts ``"fused"`` (the
    operator can run them) and ``"stock: <reason>"``; ``heads``/``head_dim`` of the last call."""

    calls: collections.Counter = field(default_factory=collections.Counter)
    heads: Optional[int] = None
    head_dim: Optional[int] = None

    @property
    def refusals(self) -> List[str]:
        return sorted(key[len("stock: "):] for key in self.calls if key.startswith("stock: "))


class _ObserveMode(TorchFunctionMode):
    def __init__(self, stack: List[nn.Module], found: Dict[int, ObservedSite]):
        super().__init__()
        self.stack, self.found = stack, found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.stack:
            query, key, value, attn_mask, dropout_p, is_causal, _, enable_gqa = _sdpa_arguments(*args, **kwargs)
            reason = explain_refusal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
            site = self.found.setdefault(id(self.stack[-1]), ObservedSite())
            site.calls["fused" if reason is None else f"stock: {reason}"] += 1
            if isinstance(query, torch.Tensor) and query.dim() == 4:
                site.heads, site.head_dim = int(query.shape[1]), int(query.shape[-1])
        return func(*args, **kwargs)


def observe_calls(model: nn.Module, inputs) -> Dict[int, ObservedSite]:
    """Runs ``model(**inputs)`` (a mapping; a tuple is passed positionally) without gradients and
    returns, per module id, the SDPA calls made while that module was the innermost one running.
    Calls whose innermost module is one of torch.nn's own (``nn.MultiheadAttention``) are left out:
    those layers are replaced, not routed. Raises what the model raises."""
    from torch.nn.modules import module as module_hooks

    stack: List[nn.Module] = []
    found: Dict[int, ObservedSite] = {}

    def enter(module, args):
        stack.append(module)

    def leave(module, args, output):
        if stack and stack[-1] is module:
            stack.pop()

    handles = [module_hooks.register_module_forward_pre_hook(enter),
               module_hooks.register_module_forward_hook(leave, always_call=True)]
    try:
        with torch.no_grad(), _ObserveMode(stack, found):
            model(*inputs) if isinstance(inputs, (tuple, list)) else model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    by_id = {id(m): m for m in model.modules()}
    return {key: site for key, site in found.items()
            if key in by_id and not (type(by_id[key]).__module__ or "").startswith("torch.")}
