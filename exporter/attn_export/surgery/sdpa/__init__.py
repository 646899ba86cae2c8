"""The SDPA route's machinery: ``F.scaled_dot_product_attention`` calls inside a model run on the
fused core operator (:func:`attn_export.attention`). The route that uses it is
:mod:`attn_export.surgery.routes.sdpa`; the parts, one job each:

* ``observe``: sites are the modules in which SDPA calls run. :func:`observe_calls` runs a sample
  forward and attributes every call to the innermost module on the call stack, however the call
  is reached (a processor object, a dispatch function, a closure or a callable stored on the
  instance).
* ``source``: without a sample forward, :func:`calls_sdpa` reads the source (the code object's
  names, following helper functions and methods of the same class two levels deep): a hint,
  which misses indirect calls.
* ``intercept``: :func:`route_module` gives a site an instance ``forward`` (:class:`RoutedForward`)
  that runs the class's own forward under :class:`SdpaMode`, a ``TorchFunctionMode`` that
  intercepts each SDPA call made while it runs, reached however it is.
* ``translate``: one call in the operator's terms (:func:`sdpa_via_operator`), or why it cannot
  be (:func:`explain_refusal`):

  * boolean masks: SDPA's ``True`` = may attend is inverted (the operator's ``True`` = masked
    out); floating masks are additive in both;
  * masks are made 4-D ([1, ...] prepended; 3-D inputs get a head axis) and their query/key axes
    expanded when broadcast; a ``[B|1, 1, 1, Lk]`` mask becomes the key-padding mask;
  * ``is_causal`` is top-left aligned in both (``tril`` of an ``Lq x Lk`` matrix of ones);
  * ``enable_gqa``: the key/value heads are passed as they are (the operator reads head
    ``h // g``, SDPA's ``repeat_interleave`` order); a single key/value head (multi-query
    attention, e.g. Falcon) broadcasts to every query head, as SDPA broadcasts it;
  * 3-D ``[N, L, E]`` inputs run as ``[N, 1, L, E]``.

Calls the operator cannot express run on PyTorch's SDPA unchanged, and the reason is recorded on
the site (:attr:`RoutedForward.calls`): ``dropout_p > 0``, a mask that requires grad while
gradients are on (the operator treats masks as constants; during ``torch.export`` the mask is
detached, since an exported graph has no backward), ``attn_mask`` together with ``is_causal``
(SDPA refuses it), inputs other than 3-D/4-D, head counts or batch sizes that differ without
``enable_gqa``, unsupported dtypes or devices.

The instance ``forward`` refers to its module, so ``copy.deepcopy`` carries the route to the
copy, and ``torch.export`` (non-strict) traces through the mode: each routed call becomes one
``attn_export::attention`` node, hence one ``FusedAttention`` ONNX node.
"""
from attn_export.surgery.sdpa.intercept import (
    RoutedForward,
    SdpaMode,
    call_counter,
    is_routed,
    route_module,
    routing,
    unroute_module,
)
from attn_export.surgery.sdpa.observe import ObservedSite, observe_calls
from attn_export.surgery.sdpa.source import SDPA_NAME, calls_sdpa, sites
from attn_export.surgery.sdpa.translate import (
    SUPPORTED_DTYPES,
    explain_refusal,
    is_one,
    known_equal,
    repeat_heads,
    sdpa_via_operator,
)

__all__ = [
    "RoutedForward", "SdpaMode", "call_counter", "is_routed", "route_module", "routing", "unroute_module",
    "ObservedSite", "observe_calls", "SDPA_NAME", "calls_sdpa", "sites",
    "SUPPORTED_DTYPES", "explain_refusal", "is_one", "known_equal", "repeat_heads", "sdpa_via_operator",
]
