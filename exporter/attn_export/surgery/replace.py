"""Model surgery: swap every ``torch.nn.MultiheadAttention`` of a model for
:class:`~attn_export.FusedMultiheadAttention`, in place, and say exactly what happened.

    >>> report = attn_export.replace_attention(model)
    >>> print(report.num_replaced, report.skipped)
    >>> report.to_dict()          # JSON-ready
    >>> rich.print(report.table())

Replaced layers share their parameters with the originals (the same ``Parameter`` objects), so
optimizers, tied weights and ``state_dict`` keys are unchanged. Every ``nn.MultiheadAttention``
configuration is replaced; those that run on the attention-core operator rather than the layer
operator (``kdim``/``vdim``, ``add_bias_kv``, ``add_zero_attn``) carry a note saying so. Layers
that cannot be swapped safely (a subclass that overrides ``forward``, the model itself) are left
in place and listed with the reason.

Hugging Face transformers models are not patched: their attention layers look their attention
function up by name in transformers' ``AttentionInterface``, so the model's
``attn_implementation`` is set to ``"attn_export"`` (:mod:`attn_export.surgery.transformers`) and every layer is
checked to dispatch there; such layers are reported as ``routed``. Attention layers that compute
attention themselves cannot be reached this way and are listed as skipped, with the reason.

Modules in which ``F.scaled_dot_product_attention`` calls run (timm, diffusers' processors,
torchtune, Whisper-style and nanoGPT-style code, most research models) get an instance ``forward``
that runs those calls on the operator (:mod:`attn_export.surgery.sdpa_route`); they are reported
with ``found="sdpa"``. With example inputs a sample forward finds them, as they run.

PyTorch's native fast paths are kept from bypassing the fused layers, per instance:

* ``nn.TransformerEncoderLayer`` in eval mode calls ``torch._transformer_encoder_layer_fwd``
  with the attention weights directly. It skips that path when a submodule has a forward hook,
  and every ``FusedMultiheadAttention`` carries a no-op pre-hook (on its ``out_proj``) for that
  reason.
* ``nn.TransformerEncoder`` turns padded batches into nested tensors in eval mode
  (``use_nested_tensor``); that attribute is set to False on encoders whose layers were fused.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from torch import nn

from attn_export.surgery import transformers as _hf
from attn_export.surgery import sdpa_route as _sdpa
from attn_export.ops.module import FusedMultiheadAttention, StockMultiheadAttention, fusion_notes
from attn_export.surgery.site_report import (  # noqa: F401 - re-exported: the statuses belong to the report
    ALREADY_FUSED,
    REPLACED,
    REWRITTEN,
    ROUTED,
    SKIPPED,
    WILL_REPLACE,
    WILL_ROUTE,
    AttentionLayer,
    CoverageError,
    ReplacementReport,
    _qualname,
)


def _layer_notes(module: nn.Module) -> List[str]:
    notes = fusion_notes(module)
    if getattr(module, "dropout", 0.0) > 0.0:
        notes.append(f"dropout={module.dropout}: unfused in training mode (dropout is not fused); fused in eval")
    return notes


def _is_attention_like(module: nn.Module) -> bool:
    return "attention" in type(module).__name__.lower()


def _sdpa_notes(module: nn.Module) -> List[str]:
    for name in ("attn_drop", "attn_dropout", "attention_dropout", "dropout", "dropout_p", "attn_pdrop"):
        value = getattr(module, name, None)
        value = value.p if isinstance(value, nn.Dropout) else value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return [f"{name}={value}: calls with dropout_p > 0 (training) run on PyTorch's SDPA (dropout is not "
                    "fused); fused otherwise"]
    return []


def _plan(model: nn.Module, hf_layers: Optional[list] = None, sdpa_layers: Optional[list] = None,
          observed: Optional[Dict[int, _sdpa.ObservedSite]] = None):
    """Every attention layer (by first path) and, per module id, every (path, parent, attr).
    Attention layers of transformers models that dispatch through its AttentionInterface are
    appended to ``hf_layers`` as (layer, module), modules in which F.scaled_dot_product_attention
    calls run to ``sdpa_layers``: those a sample forward saw calling it (``observed``, from
    sdpa_route.observe_calls), or without one those whose source calls it."""
    layers: List[AttentionLayer] = []
    by_id: Dict[int, AttentionLayer] = {}
    sites: Dict[int, List[tuple[str, nn.Module, str]]] = {}
    hf_layers = [] if hf_layers is None else hf_layers
    hf_by_id: Dict[int, AttentionLayer] = {}
    sdpa_layers = [] if sdpa_layers is None else sdpa_layers
    in_hf = _hf.contains_hf_model(model)

    def visit(parent: Optional[nn.Module], attr: str, module: nn.Module, path: str) -> None:
        is_mha = isinstance(module, StockMultiheadAttention)  # the real class, whatever the name is bound to
        is_fused = isinstance(module, FusedMultiheadAttention)
        if id(module) in by_id and (is_mha or is_fused):
            by_id[id(module)].also_at.append(path)
            sites[id(module)].append((path, parent, attr))
            return
        if id(module) in hf_by_id:
            hf_by_id[id(module)].also_at.append(path)
            return
        hf_layer = _hf.classify(module) if in_hf and not (is_mha or is_fused) else None
        heads, embed = _geometry(module)
        seen = None if observed is None else observed.get(id(module))
        if hf_layer is None and not (is_mha or is_fused) and (
                seen is not None if observed is not None else _sdpa.calls_sdpa(module)):
            # A module in which F.scaled_dot_product_attention calls run: they are routed to the
            # operator (attn_export.surgery.sdpa_route); its children are visited too.
            layer = _sdpa_layer(module, path, heads, embed, seen)
            layers.append(layer)
            hf_by_id[id(module)] = layer
            sdpa_layers.append((layer, module))
            for name, child in module.named_children():
                visit(module, name, child, f"{path}.{name}" if path else name)
            return
        if is_fused:
            layer = AttentionLayer(path, _qualname(module), heads, embed, ALREADY_FUSED, notes=fusion_notes(module))
        elif is_mha:
            layer = _mha_layer(module, parent, path, heads, embed)
        elif hf_layer is not None:
            state, reason, notes = hf_layer
            heads, embed = _hf.layer_geometry(module)
            status = {"routed": ALREADY_FUSED, "routable": WILL_ROUTE}.get(state, SKIPPED)
            layer = AttentionLayer(path, _qualname(module), heads, embed, status, reason=reason,
                                   notes=notes if status != SKIPPED else [], found="routed")
            hf_layers.append((layer, module))
        else:
            # Some other module named like an attention layer: listed (so that a model whose
            # attention cannot be fused says so) unless an nn.MultiheadAttention sits inside it.
            count = len(layers)
            for name, child in module.named_children():
                visit(module, name, child, f"{path}.{name}" if path else name)
            if parent is not None and _is_attention_like(module) and len(layers) == count:
                if in_hf:
                    reason = ("does not dispatch through transformers' AttentionInterface (it computes attention "
                              "itself), so attn_implementation cannot route it")
                elif observed is not None and _sdpa.calls_sdpa(module):
                    reason = ("its source calls F.scaled_dot_product_attention, but the sample forward made no such "
                              "call in it (it took another path, e.g. a switch such as timm's fused_attn=False)")
                else:
                    reason = ("not a torch.nn.MultiheadAttention and "
                              + ("no F.scaled_dot_product_attention call ran in it in the sample forward"
                                 if observed is not None else "its forward calls no F.scaled_dot_product_attention")
                              + " (hand-written softmax(q k^T) v is rewritten in the export, where it matches)")
                layers.append(AttentionLayer(path, _qualname(module), heads, embed, SKIPPED, reason=reason, found=""))
            return
        layers.append(layer)
        if hf_layer is not None:
            hf_by_id[id(module)] = layer
            return
        by_id[id(module)] = layer
        sites[id(module)] = [(path, parent, attr)]

    visit(None, "", model, "")
    return layers, sites


def _own_attribute(module: nn.Module, *names: str):
    """The first of ``names`` the module has as an instance or class attribute. Not getattr
    alone: diffusers' models answer unknown names from their config with a FutureWarning."""
    for name in names:
        if name in vars(module) or hasattr(type(module), name):
            value = getattr(module, name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _geometry(module: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """(heads, embed dim) where the module says them under a common name, else None."""
    return (_own_attribute(module, "num_heads", "num_attention_heads", "heads", "n_head"),
            _own_attribute(module, "embed_dim", "hidden_size", "inner_dim"))


def _sdpa_layer(module: nn.Module, path: str, heads, embed, seen: Optional[_sdpa.ObservedSite]) -> AttentionLayer:
    """A module in which SDPA calls run: to be routed, unless every call it made in the sample
    forward (``seen``) is one the operator cannot express. Heads and embed dim from its calls
    where the module does not name them."""
    if seen is not None and seen.heads is not None:
        heads = heads if heads is not None else seen.heads
        embed = embed if embed is not None else seen.heads * seen.head_dim
    if _sdpa.is_routed(module):
        status, reason = ALREADY_FUSED, None
    elif seen is not None and seen.refusals:
        status = SKIPPED
        reason = "its F.scaled_dot_product_attention call(s) would run on PyTorch's SDPA: " + "; ".join(seen.refusals)
    else:
        status, reason = WILL_ROUTE, None
    return AttentionLayer(path, _qualname(module), heads, embed, status, reason=reason,
                          notes=_sdpa_notes(module) if status != SKIPPED else [], found="sdpa")


def _mha_layer(module: nn.MultiheadAttention, parent, path: str, heads, embed) -> AttentionLayer:
    """An nn.MultiheadAttention: replaced, unless its forward is overridden or it is the model."""
    reasons = []
    if type(module).forward is not StockMultiheadAttention.forward:
        reasons.append(f"{type(module).__qualname__} overrides nn.MultiheadAttention.forward")
    if parent is None:
        reasons.append("the model itself is the attention layer: use FusedMultiheadAttention.from_module")
    return AttentionLayer(path, _qualname(module), heads, embed, SKIPPED if reasons else WILL_REPLACE,
                          reason="; ".join(reasons) or None, notes=[] if reasons else _layer_notes(module))


def _sdpa_note(sdpa_layers, applied: bool) -> List[str]:
    if not any(layer.status in (ROUTED, WILL_ROUTE) for layer, _ in sdpa_layers):
        return []
    verb = "run" if applied else "will run"
    return [f"F.scaled_dot_product_attention calls of the 'sdpa' sites {verb} on the fused operator; calls it "
            "cannot express (dropout_p > 0, a mask that requires grad, ...) stay on PyTorch's SDPA "
            "(attn_export.surgery.sdpa_route.calls(module) counts both)"]


def _source_note(layers: List[AttentionLayer], inputs) -> List[str]:
    # Not needed where every layer found is a module or a transformers layer: those are found by type.
    if inputs is not None or (layers and all(layer.found in ("module", "routed") for layer in layers)):
        return []
    return ["no sample forward ran, so F.scaled_dot_product_attention calls were looked for in the modules' source, "
            "which misses calls through processors, dispatch functions and stored callables: pass example inputs"]


def _routing_note(hf_layers, applied: bool) -> List[str]:
    if not any(layer.status in (ROUTED, WILL_ROUTE) for layer, _ in hf_layers):
        return []
    verb = "are routed" if applied else "will be routed"
    return [f"transformers attention layers {verb} through transformers' AttentionInterface "
            f"(attn_implementation='{_hf.IMPLEMENTATION}'); the modules themselves stay in place"]


def _observe(model: nn.Module, inputs) -> Optional[Dict[int, _sdpa.ObservedSite]]:
    if inputs is None:
        return None
    from attn_export.errors import InputError

    try:
        return _sdpa.observe_calls(model, inputs)
    except Exception as exc:  # noqa: BLE001 - the model's own error, in one line
        shapes = ([list(t.shape) for t in inputs] if isinstance(inputs, (tuple, list))
                  else {n: list(getattr(t, "shape", ())) for n, t in inputs.items()})
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"the model rejected the example inputs {shapes} (in the sample forward that finds the "
                         f"attention calls): {first}") from exc


def inspect_attention(model: nn.Module, inputs=None) -> ReplacementReport:
    """What :func:`replace_attention` would do, without changing the model. With ``inputs`` (a
    name -> tensor mapping, or a tuple of positional inputs) a sample forward finds the modules in
    which F.scaled_dot_product_attention calls run; without, their source is read (a hint)."""
    hf_layers: list = []
    sdpa_layers: list = []
    layers, _ = _plan(model, hf_layers, sdpa_layers, _observe(model, inputs))
    notes = _routing_note(hf_layers, applied=False) + _sdpa_note(sdpa_layers, applied=False) + _source_note(layers, inputs)
    return ReplacementReport(layers, notes=notes, applied=False)


def replace_attention(
    model: nn.Module, inputs=None, *, min_replaced: Optional[int] = None, require_all: bool = False
) -> ReplacementReport:
    """Replaces every supported ``nn.MultiheadAttention`` in ``model`` (in place) by a
    :class:`FusedMultiheadAttention` sharing its parameters, routes the attention layers of
    Hugging Face transformers models to the operator (``attn_implementation="attn_export"``,
    see :mod:`attn_export.surgery.transformers`), routes the ``F.scaled_dot_product_attention`` calls of modules
    whose forward makes them (:mod:`attn_export.surgery.sdpa_route`), and returns the report.

    Args:
        model: any ``nn.Module``; nested ``nn.TransformerEncoderLayer`` /
            ``nn.TransformerDecoderLayer`` (self- and cross-attention) included, and
            transformers ``PreTrainedModel``s (the model itself or nested ones).
        inputs: example inputs (name -> tensor, or a tuple): a sample forward (without gradients)
            finds the modules in which F.scaled_dot_product_attention calls run, however they are
            reached; without, modules whose source calls it are routed.
        min_replaced: raise :class:`CoverageError` (before changing anything) when fewer than
            this many layers would end up fused.
        require_all: raise :class:`CoverageError` when any attention layer cannot be fused.
    """
    hf_layers: list = []
    sdpa_layers: list = []
    layers, sites = _plan(model, hf_layers, sdpa_layers, _observe(model, inputs))
    report = ReplacementReport(layers, notes=_source_note(layers, inputs))
    problem = report.coverage_error(min_replaced, require_all)
    if problem:
        raise CoverageError(problem)

    # Attention layers of transformers models: routed, not swapped (their attention function is
    # looked up by name in transformers' AttentionInterface), then checked one by one.
    if any(layer.status == WILL_ROUTE for layer, _ in hf_layers):
        refusals = _hf.route(model)
        for layer, module in hf_layers:
            if layer.status != WILL_ROUTE:
                continue
            config = _hf.module_config(module)
            if config is not None and config._attn_implementation == _hf.IMPLEMENTATION:
                layer.status = ROUTED
            else:
                layer.status = SKIPPED
                layer.notes = []
                now = None if config is None else config._attn_implementation
                layer.reason = (
                    f"transformers did not set attn_implementation='{_hf.IMPLEMENTATION}' on it (it stays "
                    f"{now!r}; the model class may not support changing it after loading: load it with "
                    f"attn_implementation='{_hf.IMPLEMENTATION}')"
                    + (f"; {'; '.join(refusals)}" if refusals else "")
                )
        report.notes.extend(_routing_note(hf_layers, applied=True))

    # Modules calling F.scaled_dot_product_attention: an instance forward routes their calls.
    for layer, module in sdpa_layers:
        if layer.status == WILL_ROUTE:
            _sdpa.route_module(module)
            layer.status = ROUTED
    report.notes.extend(_sdpa_note(sdpa_layers, applied=True))

    by_path = {layer.path: layer for layer in layers}
    fused_paths: List[str] = []
    for module_id, where in sites.items():
        layer = by_path[where[0][0]]
        if layer.status != WILL_REPLACE:
            continue
        original = where[0][1]._modules[where[0][2]]
        fused = FusedMultiheadAttention.from_module(original)
        for path, parent, attr in where:
            setattr(parent, attr, fused)
            fused_paths.append(path)
        layer.status = REPLACED

    # nn.TransformerEncoder's nested-tensor fast path would feed nested tensors to the fused
    # layers; switch it off on the encoders that now hold fused layers (instance attribute).
    for path, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoder) and getattr(module, "use_nested_tensor", False):
            prefix = f"{path}." if path else ""
            if any(p.startswith(prefix) for p in fused_paths):
                module.use_nested_tensor = False
                report.notes.append(
                    f"{path or '(model)'}: use_nested_tensor set to False (its nested-tensor fast path "
                    "would bypass the fused layers)"
                )
    return report
