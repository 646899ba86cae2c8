"""diffusers' native route: attention processors whose SDPA calls run on the fused operator.

diffusers' attention modules hand their work to a processor object (``attn.processor``), and
its public API swaps processors (``model.set_attn_processor``). :func:`use_fused_processors`
gives every attention module of a model a processor of its own kind (``AttnProcessor2_0``,
``JointAttnProcessor2_0``, ``FluxAttnProcessor`` ...) whose calls run under the SDPA route
(:mod:`attn_export.surgery.sdpa_route`): the same computation, each SDPA call one
``attn_export::attention`` call, hence one FusedAttention node in an export. The processor keeps
its class's ``__call__`` signature (diffusers reads it to pass ``cross_attention_kwargs``) and
counts its calls (``processor.calls``: ``"fused"`` and ``"stock: <reason>"``).

:func:`attn_export.replace_attention` sets these processors module by module (the diffusers route,
:mod:`attn_export.surgery.routes.diffusers`); :func:`use_fused_processors` does it for code that
manages diffusers' processors itself, e.g. a pipeline's ``pipe.unet``.
"""
from __future__ import annotations

import collections
import functools
from typing import Dict

from torch import nn

from attn_export.surgery.sdpa.intercept import routing

_classes: Dict[type, type] = {}


def is_fused_processor(processor) -> bool:
    return bool(getattr(type(processor), "_attn_export_fused", False))


def fused_processor_class(processor_cls: type) -> type:
    """The subclass of a diffusers processor class whose ``__call__`` runs on the operator."""
    if getattr(processor_cls, "_attn_export_fused", False):
        return processor_cls
    if processor_cls not in _classes:
        original = processor_cls.__call__

        @functools.wraps(original)  # keeps the signature diffusers inspects
        def __call__(self, *args, **kwargs):
            with routing(self):
                return original(self, *args, **kwargs)

        _classes[processor_cls] = type(f"Fused{processor_cls.__name__}", (processor_cls,), {
            "__call__": __call__, "_attn_export_fused": True, "__module__": __name__,
            "__doc__": f"diffusers' {processor_cls.__name__} with its SDPA calls on attn_export's operator."})
    return _classes[processor_cls]


def fused_processor(processor):
    """A copy of ``processor`` (a diffusers attention processor instance) whose SDPA calls run on
    the operator; its state (e.g. IP-adapter weights) is shared, not copied."""
    cls = fused_processor_class(type(processor))
    if type(processor) is cls:
        return processor
    fused = cls.__new__(cls)
    fused.__dict__.update(vars(processor))
    fused.calls = collections.Counter()
    return fused


def use_fused_processors(model: nn.Module) -> int:
    """Sets a fused processor on every attention module of a diffusers model, through its public
    ``set_attn_processor``; returns how many. Raises TypeError for a model without that API."""
    if not (hasattr(model, "attn_processors") and hasattr(model, "set_attn_processor")):
        raise TypeError(f"{type(model).__name__} has no diffusers attention-processor API (set_attn_processor); "
                        "attn_export.replace_attention(model, inputs) routes any model's SDPA calls")
    processors = {name: fused_processor(p) for name, p in model.attn_processors.items()}
    count = len(processors)
    model.set_attn_processor(processors)  # empties the dict it is given
    return count


def processor_calls(model: nn.Module) -> Dict[str, int]:
    """The SDPA calls the fused processors of ``model`` have made, summed over them
    (:func:`attn_export.surgery.fused_calls` of their attention modules, in SDPA's terms)."""
    from attn_export.surgery.routes import CallCount, fused_calls

    if not hasattr(model, "attn_processors"):
        return {}
    total = CallCount()
    for module in model.modules():
        if is_fused_processor(module.__dict__.get("processor")):
            total = total + fused_calls(module)
    return total.as_counter()
