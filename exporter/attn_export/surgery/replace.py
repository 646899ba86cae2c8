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
that runs those calls on the operator (:mod:`attn_export.surgery.routes.sdpa`); they are reported
with ``found="sdpa"``. With example inputs a sample forward finds them, as they run.

Each of these ways is a route (:mod:`attn_export.surgery.routes`): this module walks the model
and asks the routes of the registry, in order, which of them reaches each module, then applies
them; what the report says about a site comes from its route (its ``found`` is the route's name).
:func:`restore_attention` undoes what :func:`replace_attention` did.

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

from attn_export.errors import InputError
from attn_export.surgery import routes as _routes
from attn_export.surgery.geometry import geometry as _geometry
from attn_export.surgery.routes.base import Scan, Site
from attn_export.surgery.routes.undo import Surgery
from attn_export.surgery.sdpa.observe import observe_calls
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


def _is_attention_like(module: nn.Module) -> bool:
    return "attention" in type(module).__name__.lower()


def _plan(model: nn.Module, observed: Optional[Dict[int, object]] = None):
    """Every attention site (by first path): the report rows, and the sites the routes claimed.
    ``observed``: the SDPA calls a sample forward saw per module id (sdpa.observe.observe_calls),
    None without one. Each row's ``found`` is the name of the route that claimed it."""
    scan = Scan(model, observed)
    routes = list(_routes.ROUTES)
    layers: List[AttentionLayer] = []
    sites: List[Site] = []
    by_id: Dict[int, Site] = {}

    def visit_children(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            visit(module, name, child, f"{path}.{name}" if path else name)

    def visit(parent: Optional[nn.Module], attr: str, module: nn.Module, path: str) -> None:
        if id(module) in by_id:  # the same module reached by another path
            by_id[id(module)].layer.also_at.append(path)
            by_id[id(module)].places.append((path, parent, attr))
            return
        for route in routes:
            layer = route.claim(scan, module, parent, path)
            if layer is not None:
                layer.found = route.name
                layers.append(layer)
                by_id[id(module)] = Site(layer, module, [(path, parent, attr)], route)
                sites.append(by_id[id(module)])
                if route.descend:
                    visit_children(module, path)
                return
        # No route reaches it: listed (so that a model whose attention cannot be fused says so)
        # when named like an attention layer and no site was found inside it.
        count = len(layers)
        visit_children(module, path)
        if parent is not None and _is_attention_like(module) and len(layers) == count:
            heads, embed = _geometry(module)
            layers.append(AttentionLayer(path, _qualname(module), heads, embed, SKIPPED,
                                         reason=_unreached(scan, routes, module), found=""))

    visit(None, "", model, "")
    return layers, sites


def _unreached(scan: Scan, routes, module: nn.Module) -> str:
    """Why no route reaches ``module``: the most specific route's reason, else what it lacks for
    each route, in table order."""
    for route in routes:
        reason = route.decline(scan, module)
        if reason is not None:
            return reason
    lacks = [clause for clause in (route.missing(scan) for route in routes) if clause]
    return (" and ".join(lacks) or "no route reaches it") + \
        " (hand-written softmax(q k^T) v is rewritten in the export, where it matches)"


def _by_route(sites: List[Site], route) -> List[Site]:
    return [site for site in sites if site.route is route]


def _add_notes(notes: List[str], new: List[str]) -> None:
    # Two routes may note the same thing (sites found by SDPA calls, whichever route runs them).
    notes.extend(note for note in new if note not in notes)


def _unobserved_notes(routes, layers: List[AttentionLayer], inputs) -> List[str]:
    """Without a sample forward, the notes of the routes that may have missed sites; none where
    every site found is one a route recognizes by its class."""
    by_type = {route.name for route in routes if route.by_type}
    if inputs is not None or (layers and all(layer.found in by_type for layer in layers)):
        return []
    notes: List[str] = []
    _add_notes(notes, [route.unobserved_note for route in routes if route.unobserved_note])
    return notes


def _observe(model: nn.Module, inputs) -> Optional[Dict[int, object]]:
    if inputs is None:
        return None
    try:
        return observe_calls(model, inputs)
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
    layers, sites = _plan(model, _observe(model, inputs))
    notes: List[str] = []
    for route in _routes.ROUTES:
        _add_notes(notes, route.notes(_by_route(sites, route), applied=False))
    return ReplacementReport(layers, notes=notes + _unobserved_notes(_routes.ROUTES, layers, inputs), applied=False)


def replace_attention(
    model: nn.Module, inputs=None, *, min_replaced: Optional[int] = None, require_all: bool = False
) -> ReplacementReport:
    """Replaces every supported ``nn.MultiheadAttention`` in ``model`` (in place) by a
    :class:`FusedMultiheadAttention` sharing its parameters, routes the attention layers of
    Hugging Face transformers models to the operator (``attn_implementation="attn_export"``,
    see :mod:`attn_export.surgery.transformers`), gives diffusers' attention modules fused
    processors (:mod:`attn_export.surgery.routes.diffusers`), routes the ``F.scaled_dot_product_attention``
    calls of other modules whose forward makes them (:mod:`attn_export.surgery.routes.sdpa`), and
    returns the report: the routes of :data:`attn_export.surgery.routes.ROUTES`, in order.

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

    The report keeps what was done: :func:`restore_attention` undoes it.
    """
    layers, sites = _plan(model, _observe(model, inputs))
    report = ReplacementReport(layers, notes=_unobserved_notes(_routes.ROUTES, layers, inputs))
    problem = report.coverage_error(min_replaced, require_all)
    if problem:
        raise CoverageError(problem)
    steps = []
    for route in _routes.ROUTES:
        own = _by_route(sites, route)
        notes, state = route.apply(model, own)
        steps.append((route, state))
        _add_notes(report.notes, route.notes(own, applied=True) + notes)
    report.surgery = Surgery(model, steps)
    return report


def restore_attention(model: nn.Module, report: ReplacementReport) -> None:
    """Undoes :func:`replace_attention` on ``model``, whose report this is: the original modules
    back in the same places (the same objects), instance attributes it added removed, those it
    changed (``use_nested_tensor``, transformers' ``attn_implementation``) set back. Raises
    ValueError for the report of another model, a plan (nothing was changed) or a second undo."""
    if report.surgery is None:
        raise ValueError("this report changed nothing (a plan, or the report of inspect_attention): nothing to restore")
    report.surgery.restore(model)
