"""The diffusers route: attention processors whose SDPA calls run on the fused operator.

diffusers' attention modules hand their work to a processor object (``attn.processor``), and
its public API swaps processors (``set_processor``, ``model.set_attn_processor``). An attention
module gets a processor of its own kind (``AttnProcessor2_0``, ``JointAttnProcessor2_0``,
``FluxAttnProcessor`` ...) whose calls run under the SDPA route's mode
(:func:`attn_export.surgery.sdpa.intercept.routing`): the same computation, each SDPA call one
``attn_export::attention`` call, hence one FusedAttention node in an export. The processor keeps
its class's ``__call__`` signature (diffusers reads it to pass ``cross_attention_kwargs``) and
counts its calls (``processor.calls``: ``"fused"`` and ``"stock: <reason>"``). The module's
``forward`` is left alone.

Sites are the modules with a diffusers processor in which a sample forward saw SDPA calls (or,
without one, whose processor's ``__call__`` names SDPA), reported as the SDPA route reports them
(the same statuses, reasons and notes; ``found="diffusers"``). Processors that are modules (they
hold weights, e.g. IP-adapter ones) are left to the SDPA route. Undo sets the original processor
back; the calls are counted on the fused processor.

:func:`use_fused_processors` does the same for a whole model through ``set_attn_processor``, for
code that manages diffusers' processors itself, e.g. a pipeline's ``pipe.unet``.
"""
from __future__ import annotations

import collections
import functools
from typing import Dict, Optional

from torch import nn

from attn_export.surgery.routes.base import CallCount, Scan
from attn_export.surgery.routes.sdpa import SdpaSites, sdpa_site
from attn_export.surgery.sdpa.intercept import routing
from attn_export.surgery.sdpa.source import _calls_sdpa
from attn_export.surgery.site_report import AttentionLayer

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


def processor_of(module: nn.Module):
    """The processor object of a diffusers attention module (None for anything else)."""
    if not (type(module).__module__ or "").startswith("diffusers.") or not hasattr(module, "set_processor"):
        return None
    processor = module.__dict__.get("processor")
    return None if processor is None or isinstance(processor, nn.Module) else processor


def processor_counts(processor) -> Optional[CallCount]:
    """The calls a fused processor has made (None for any other processor)."""
    return CallCount.from_counter(getattr(processor, "calls", {})) if is_fused_processor(processor) else None


class DiffusersProcessors(SdpaSites):
    name = "diffusers"

    def claim(self, scan: Scan, module: nn.Module, parent: Optional[nn.Module], path: str) -> Optional[AttentionLayer]:
        processor = processor_of(module)
        if processor is None:
            return None
        cls = type(processor)
        return sdpa_site(scan, module, path, lambda: _calls_sdpa(cls.__call__, cls, 2, set()),
                         is_fused_processor(processor))

    def route_site(self, module: nn.Module):
        original = module.processor
        module.set_processor(fused_processor(original))
        return original

    def undo(self, model: nn.Module, applied) -> None:
        for path, original in applied:
            model.get_submodule(path).set_processor(original)

    def calls(self, module: nn.Module) -> Optional[CallCount]:
        processor = processor_of(module)
        return None if processor is None else processor_counts(processor)


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
    """The SDPA calls the fused processors of ``model`` have made, summed over them (what
    :func:`attn_export.surgery.fused_calls` counts at their attention modules, in SDPA's terms)."""
    if not hasattr(model, "attn_processors"):
        return {}
    total = CallCount()
    for module in model.modules():
        count = processor_counts(module.__dict__.get("processor"))
        if count is not None:
            total = total + count
    return total.as_counter()
