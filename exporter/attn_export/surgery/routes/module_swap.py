"""The module route: every ``torch.nn.MultiheadAttention`` swapped for a
:class:`~attn_export.FusedMultiheadAttention` sharing its parameters, in every place it sits.

PyTorch's native fast paths are kept from bypassing the fused layers, per instance:
``nn.TransformerEncoderLayer`` skips ``torch._transformer_encoder_layer_fwd`` because every fused
layer's ``out_proj`` carries a no-op forward pre-hook, and ``nn.TransformerEncoder``'s
nested-tensor path (``use_nested_tensor``) is switched off on encoders that now hold fused layers.
Undo puts the original modules back in the same places and the encoders' attribute back.

Calls are not counted: a hook on the fused module would send every call through nn.Module's
slower hook path (see ``ops/module.py``), and a swapped layer runs the operator on every call
except dropout in training, which its notes say.
"""
from __future__ import annotations

from typing import List, Optional

from torch import nn

from attn_export.ops.module import FusedMultiheadAttention, StockMultiheadAttention, fusion_notes
from attn_export.surgery.geometry import geometry
from attn_export.surgery.routes.base import Route, Scan, Site, restore_attributes, saved_attributes
from attn_export.surgery.site_report import ALREADY_FUSED, REPLACED, SKIPPED, WILL_REPLACE, AttentionLayer, _qualname


def _layer_notes(module: nn.Module) -> List[str]:
    notes = fusion_notes(module)
    if getattr(module, "dropout", 0.0) > 0.0:
        notes.append(f"dropout={module.dropout}: unfused in training mode (dropout is not fused); fused in eval")
    return notes


def _mha_layer(module: nn.MultiheadAttention, parent, path: str, heads, embed) -> AttentionLayer:
    """An nn.MultiheadAttention: replaced, unless its forward is overridden or it is the model."""
    reasons = []
    if type(module).forward is not StockMultiheadAttention.forward:
        reasons.append(f"{type(module).__qualname__} overrides nn.MultiheadAttention.forward")
    if parent is None:
        reasons.append("the model itself is the attention layer: use FusedMultiheadAttention.from_module")
    return AttentionLayer(path, _qualname(module), heads, embed, SKIPPED if reasons else WILL_REPLACE,
                          reason="; ".join(reasons) or None, notes=[] if reasons else _layer_notes(module))


def _parent_path(path: str) -> tuple[str, str]:
    parent, _, attr = path.rpartition(".")
    return parent, attr


class ModuleSwap(Route):
    name = "module"
    by_type = True

    def missing(self, scan: Scan) -> Optional[str]:
        return "it is not a torch.nn.MultiheadAttention"

    def claim(self, scan: Scan, module: nn.Module, parent: Optional[nn.Module], path: str) -> Optional[AttentionLayer]:
        if isinstance(module, FusedMultiheadAttention):
            heads, embed = geometry(module)
            return AttentionLayer(path, _qualname(module), heads, embed, ALREADY_FUSED, notes=fusion_notes(module))
        if isinstance(module, StockMultiheadAttention):  # the real class, whatever torch.nn's name is bound to
            return _mha_layer(module, parent, path, *geometry(module))
        return None

    def apply(self, model: nn.Module, sites: List[Site]):
        swapped, fused_paths = [], []
        for site in sites:
            if site.layer.status != WILL_REPLACE:
                continue
            fused = FusedMultiheadAttention.from_module(site.module)
            for path, parent, attr in site.places:
                setattr(parent, attr, fused)
                fused_paths.append(path)
            site.layer.status = REPLACED
            swapped.append((site.module, [path for path, _, _ in site.places]))
        encoders, notes = _nested_tensor_off(model, fused_paths)
        return notes, (swapped, encoders)

    def undo(self, model: nn.Module, applied) -> None:
        swapped, encoders = applied
        for path, saved in encoders:
            restore_attributes(model.get_submodule(path), saved)
        for original, paths in swapped:
            for path in paths:
                parent, attr = _parent_path(path)
                setattr(model.get_submodule(parent), attr, original)


def _nested_tensor_off(model: nn.Module, fused_paths: List[str]):
    """nn.TransformerEncoder's nested-tensor fast path would feed nested tensors to the fused
    layers: switched off (an instance attribute) on the encoders that now hold fused layers.
    Returns (path, saved attribute) per encoder changed, and one note each."""
    changed, notes = [], []
    for path, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            prefix = f"{path}." if path else ""
            if any(p.startswith(prefix) for p in fused_paths):
                changed.append((path, saved_attributes(module, ["use_nested_tensor"])))
                module.use_nested_tensor = False
                notes.append(f"{path or '(model)'}: use_nested_tensor set to False (its nested-tensor fast path "
                             "would bypass the fused layers)")
    return changed, notes
