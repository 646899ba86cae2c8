"""Which attention modules of a built model dispatch through the interface, and routing the
model to the ``attn_export`` implementation."""
from __future__ import annotations

import inspect
import re
from typing import Dict, List, Optional, Tuple

from torch import nn

from attn_export.surgery.geometry import geometry
from attn_export.surgery.transformers.compat import IMPLEMENTATION, UNSERVED_KWARGS
from attn_export.surgery.transformers.interface import register

_DISPATCH_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface", "attention_interface")
_dispatch_cache: Dict[type, bool] = {}


def dispatches_through_interface(module: nn.Module) -> bool:
    """Whether ``type(module).forward`` looks its attention function up in transformers'
    ``AttentionInterface`` (the same source test transformers applies to whole model files in
    ``_can_set_attn_implementation``, narrowed to the one method)."""
    cls = type(module)
    if cls not in _dispatch_cache:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _dispatch_cache[cls] = any(marker in source for marker in _DISPATCH_MARKERS)
    return _dispatch_cache[cls]


_served_keywords = ("position_bias", "softcap")
_keywords_cache: Dict[type, Tuple[str, ...]] = {}


def _attention_call_keywords(cls: type) -> Tuple[str, ...]:
    """The keyword arguments of interest (unserved ones, and served ones worth a note) that
    ``cls.forward`` passes by name, e.g. ``s_aux=self.sinks``, ``position_bias=position_bias``."""
    if cls not in _keywords_cache:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        names = tuple(UNSERVED_KWARGS) + _served_keywords
        _keywords_cache[cls] = tuple(n for n in names if re.search(rf"\b{n}\s*=", source))
    return _keywords_cache[cls]


def module_config(module: nn.Module):
    config = getattr(module, "config", None)
    return config if config is not None and hasattr(config, "_attn_implementation") else None


def layer_geometry(module: nn.Module) -> Tuple[Optional[int], Optional[int]]:
    """(heads, hidden size) of an attention module, from its attributes or its config."""
    heads, embed = geometry(module)
    config = module_config(module)
    if heads is None and config is not None:
        heads = getattr(config, "num_attention_heads", None)
    if embed is None and config is not None:
        embed = getattr(config, "hidden_size", None)
    return (heads if isinstance(heads, int) else None), (embed if isinstance(embed, int) else None)


def classify(module: nn.Module) -> Optional[Tuple[str, Optional[str], List[str]]]:
    """For a module of a transformers model: ``None`` if it is no attention layer that
    dispatches through the interface, else (state, reason, notes) with state ``"routed"`` (already
    ``attn_export``), ``"routable"``, ``"not routable"`` or ``"skipped"`` (its calls carry
    arguments the operator does not compute, so they run transformers' eager attention even in a
    routed model; decided from the forward's source as the call decides from its arguments)."""
    if not dispatches_through_interface(module):
        return None
    config = module_config(module)
    if config is None:
        return ("not routable", "dispatches through transformers' AttentionInterface but has no config with an "
                "attn_implementation to set", [])
    notes = []
    dropout = _attention_dropout(module, config)
    if dropout:
        notes.append(f"dropout={dropout}: unfused in training mode (transformers' sdpa runs then); fused in eval")
    keywords = _attention_call_keywords(type(module))
    unserved = [f"{UNSERVED_KWARGS[name]} ({name}=...)" for name in keywords if name in UNSERVED_KWARGS]
    if unserved:
        # Decided from the forward's source, as the run decides from the call (interface.unfused_reason).
        return ("skipped", f"passes {', '.join(unserved)} to the attention function, which the fused operator "
                "does not compute: transformers' eager attention runs for this layer", [])
    if "position_bias" in keywords:
        notes.append("position bias: fused as the operator's additive mask; while training a learned bias "
                     "(gradients on) transformers' eager attention runs")
    if "softcap" in keywords:
        notes.append("logit soft-capping: the operator's softcap")
    if config._attn_implementation == IMPLEMENTATION:
        return ("routed", None, notes)
    return ("routable", None, notes)


def _attention_dropout(module: nn.Module, config) -> float:
    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attention_dropout_prob"):
        value = getattr(module, name, None)
        if value is None:
            value = getattr(config, name, None)
        if isinstance(value, nn.Dropout):
            value = value.p
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    return 0.0


def _outermost_pretrained(model: nn.Module) -> List[nn.Module]:
    from transformers import PreTrainedModel

    found: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, PreTrainedModel):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def route(model: nn.Module) -> List[str]:
    """Sets ``attn_implementation="attn_export"`` on every transformers model in ``model`` (the
    model itself or nested ones), through ``set_attn_implementation`` (sub-models included).
    Returns transformers' refusals, one line each (they are logged as warnings by transformers,
    not raised; the caller checks each layer)."""
    register()
    problems = []
    for pretrained in _outermost_pretrained(model):
        setter = getattr(pretrained, "set_attn_implementation", None)
        try:
            if setter is not None:
                setter(IMPLEMENTATION)
            else:  # transformers without set_attn_implementation: the config attribute
                pretrained.config._attn_implementation = IMPLEMENTATION
        except Exception as exc:  # noqa: BLE001 - reported per layer by the caller
            problems.append(f"{type(pretrained).__name__}: {exc}")
    return problems
