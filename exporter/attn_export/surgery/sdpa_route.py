"""The SDPA route: ``F.scaled_dot_product_attention`` calls inside a model run on the fused core
operator (:func:`attn_export.attention`).

Sites are the modules in which SDPA calls run: :func:`observe_calls` runs a sample forward and
attributes every call to the innermost module on the call stack, however the call is reached
(a processor object, a dispatch function, a closure or a callable stored on the instance). Without
a sample forward, :func:`calls_sdpa` reads the source (the code object's names, following helper
functions and methods of the same class two levels deep): a hint, which misses indirect calls.
:func:`route_module` gives a site an instance ``forward`` (:class:`RoutedForward`) that runs the
class's own forward under :class:`SdpaMode`, a ``TorchFunctionMode`` that intercepts each SDPA
call made while it runs, reached however it is, and maps it onto the operator:

* boolean masks: SDPA's ``True`` = may attend is inverted (the operator's ``True`` = masked out);
  floating masks are additive in both;
* masks are made 4-D ([1, ...] prepended; 3-D inputs get a head axis) and their query/key axes
  expanded when broadcast; a ``[B|1, 1, 1, Lk]`` mask becomes the key-padding mask;
* ``is_causal`` is top-left aligned in both (``tril`` of an ``Lq x Lk`` matrix of ones);
* ``enable_gqa``: key/value heads repeated (``repeat_interleave`` on the head axis, as SDPA); a
  single key/value head (multi-query attention, e.g. Falcon) broadcasts to every query head, as
  SDPA broadcasts it;
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
from __future__ import annotations

import collections
import contextlib
import threading
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

SDPA_NAME = "scaled_dot_product_attention"
SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_state = threading.local()


# -- discovery ---------------------------------------------------------------------------------

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


def is_routed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), RoutedForward)


# -- the route ---------------------------------------------------------------------------------

@contextlib.contextmanager
def routing(site):
    """SDPA calls made inside the block run on the operator and are counted on ``site`` (anything
    with a ``calls`` Counter), or on the innermost site when routed sites nest."""
    stack = getattr(_state, "sites", None)
    if stack is None:
        stack = _state.sites = []
    stack.append(site)
    try:
        if len(stack) == 1:
            with SdpaMode():
                yield
        else:
            yield
    finally:
        stack.pop()


class RoutedForward:
    """The instance ``forward`` of a routed module: the class's forward under :class:`SdpaMode`.
    ``calls`` counts the SDPA calls seen since routing: ``"fused"`` and ``"stock: <reason>"``."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.calls: collections.Counter = collections.Counter()

    def __call__(self, *args, **kwargs):
        with routing(self):
            return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __signature__(self):  # the class forward's, without self (torch.export binds inputs by it)
        import inspect

        signature = inspect.signature(type(self.module).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def __getattr__(self, name):  # __name__, __doc__, __code__ ... of the class forward
        if name in ("module", "calls"):
            raise AttributeError(name)
        return getattr(type(self.module).forward, name)

    def __deepcopy__(self, memo):
        import copy

        copied = RoutedForward.__new__(RoutedForward)
        memo[id(self)] = copied
        copied.module = copy.deepcopy(self.module, memo)
        copied.calls = collections.Counter()  # a new model: its own calls are counted
        return copied

    def __reduce__(self):  # pickled as its module: unpickling (not a weights-only load) restores the route
        return (_rebuild, (self.module,))


def _rebuild(module):
    return RoutedForward(module)


def route_module(module: nn.Module) -> None:
    """Routes the SDPA calls of ``module``'s forward to the operator (idempotent)."""
    if not is_routed(module):
        module.forward = RoutedForward(module)


def unroute_module(module: nn.Module) -> None:
    if is_routed(module):
        del module.__dict__["forward"]


def calls(module: nn.Module) -> Dict[str, int]:
    """The SDPA calls a routed module has made: ``{"fused": n, "stock: <reason>": m}``."""
    forward = module.__dict__.get("forward")
    return dict(forward.calls) if isinstance(forward, RoutedForward) else {}


class SdpaMode(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` calls on :func:`attn_export.attention` (see the
    module docstring); anything else passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out, reason = sdpa_via_operator(*args, **kwargs)
            stack = getattr(_state, "sites", None)
            if stack:
                stack[-1].calls["fused" if reason is None else f"stock: {reason}"] += 1
            if reason is None:
                return out
        return func(*args, **kwargs)


def is_one(size) -> bool:
    """A dimension that is literally 1 (a Python int), never a symbolic size compared (which
    would add a guard under torch.export)."""
    return isinstance(size, int) and size == 1


def known_equal(a, b) -> bool:
    """a == b known without adding a guard (symbolic sizes under torch.export)."""
    if a is b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001
        return False


def _agree(a, b) -> bool:
    """Whether two sizes that SDPA needs equal (else broadcast) are equal. Symbolic sizes (under
    torch.export) that are not known to be equal are asserted equal with ``torch._check``, as
    SDPA's own shape checks would do, unless one of them is a literal 1 (SDPA broadcasts it)."""
    if known_equal(a, b):
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    if is_one(a) or is_one(b):
        return False
    torch._check(a == b, lambda: f"scaled_dot_product_attention: sizes {a} and {b} must agree")
    return True


def _exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


def _device_supported(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("attn_export::_attention_forward", device.type.upper())
    except Exception:  # noqa: BLE001
        return False


def _sdpa_arguments(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def explain_refusal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa) -> Optional[str]:
    """Why one SDPA call cannot run on the operator (None when it can)."""
    tensors = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return "query, key and value are not all tensors"
    if any(t.is_nested for t in tensors):
        return "nested tensors"
    if dropout_p and float(dropout_p) > 0.0:
        return f"dropout_p={dropout_p} (attention dropout is not fused)"
    if query.dtype not in SUPPORTED_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtypes {query.dtype}/{key.dtype}/{value.dtype} (the operator takes one of float32, float64, " \
               "float16, bfloat16 for all three)"
    if not (_device_supported(query.device) and key.device == query.device and value.device == query.device):
        return f"device {query.device} (the operator was not built for it)"
    rank = query.dim()
    if rank not in (3, 4) or key.dim() != rank or value.dim() != rank:
        return f"query/key/value of rank {query.dim()}/{key.dim()}/{value.dim()} (3-D or 4-D are routed)"
    if not _agree(query.shape[-1], key.shape[-1]) or not _agree(key.shape[-2], value.shape[-2]):
        return "query/key head dims or key/value lengths differ"
    if not all(_agree(query.shape[0], t.shape[0]) for t in (key, value)):
        return f"batch sizes differ (query {list(query.shape)}, key {list(key.shape)}): SDPA broadcasts them"
    if rank == 4:
        hq, hk, hv = query.shape[1], key.shape[1], value.shape[1]
        if not known_equal(hk, hv):
            return f"key and value head counts differ ({hk} vs {hv})"
        if not known_equal(hq, hk) and not is_one(hk):  # one key/value head broadcasts (multi-query)
            if not enable_gqa:
                return f"query has {hq} heads and key/value {hk} without enable_gqa"
            if not (isinstance(hq, int) and isinstance(hk, int) and hk > 0 and hq % hk == 0):
                return f"enable_gqa with {hq} query heads and {hk} key/value heads (not a whole number of groups)"
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return "attn_mask is not a tensor"
        if is_causal:
            return "attn_mask together with is_causal=True (SDPA refuses it)"
        if not (attn_mask.dtype == torch.bool or attn_mask.dtype in SUPPORTED_DTYPES):
            return f"attn_mask of dtype {attn_mask.dtype}"
        if attn_mask.dim() > 4 or (rank == 3 and attn_mask.dim() > 3):
            return f"attn_mask of rank {attn_mask.dim()} for {rank}-D inputs"
        if attn_mask.requires_grad and torch.is_grad_enabled() and not _exporting():
            return "attn_mask requires grad (the operator treats masks as constants)"
    return None


def _operator_masks(attn_mask: torch.Tensor, batch, heads, lq, lk, rank: int):
    """SDPA's mask (broadcastable to [B, H, Lq, Lk], or [N, Lq, Lk] for 3-D inputs) -> the
    operator's (attn_mask [B|1, H|1, Lq, Lk], key_padding_mask [B, Lk]), booleans inverted."""
    mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
    while mask.dim() < rank:
        mask = mask.unsqueeze(0)
    if rank == 3:
        mask = mask.unsqueeze(1)  # [N|1, 1, Lq|1, Lk|1]
    b, h, mq, mk = mask.shape
    if is_one(mq) and is_one(h):  # one row per key: the key-padding mask
        kpm = mask[:, 0, 0, :]
        if is_one(mk) and not is_one(lk):
            kpm = kpm.expand(kpm.shape[0], lk)
        if is_one(b) and not is_one(batch):
            kpm = kpm.expand(batch, kpm.shape[1])
        return None, kpm
    if (is_one(mq) and not is_one(lq)) or (is_one(mk) and not is_one(lk)):
        mask = mask.expand(b, h, lq, lk)
    return mask, None


def sdpa_via_operator(*args, **kwargs) -> Tuple[Optional[torch.Tensor], Optional[str]]:
    """One SDPA call on the operator: ``(output, None)``, or ``(None, reason)`` when the call
    must run on PyTorch's SDPA."""
    from attn_export.ops.functional import attention

    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
    reason = explain_refusal(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        return None, reason
    rank = query.dim()
    if rank == 3:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    batch, heads, lq, _ = query.shape
    lk = key.shape[2]
    if not known_equal(heads, key.shape[1]):  # enable_gqa (repeat_interleave on the head axis) or broadcast
        groups = heads // key.shape[1]
        key, value = repeat_heads(key, groups), repeat_heads(value, groups)
    attn, kpm = (None, None) if attn_mask is None else _operator_masks(attn_mask, batch, heads, lq, lk, rank)
    if attn is not None and attn.requires_grad:
        attn = attn.detach()  # exporting: no backward in the graph
    if kpm is not None and kpm.requires_grad:
        kpm = kpm.detach()
    out = attention(query, key, value, attn_mask=attn, key_padding_mask=kpm, is_causal=bool(is_causal),
                    scale=scale)
    return (out.squeeze(1) if rank == 3 else out), None


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H * groups, L, D], each head repeated ``groups`` times in place
    (``repeat_interleave`` on the head axis, as SDPA's ``enable_gqa``)."""
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, l, d).reshape(b, h * groups, l, d)


def sites(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of every module of ``model`` whose forward calls SDPA (first path only)."""
    found, seen = [], set()
    for path, module in model.named_modules():
        if id(module) not in seen and calls_sdpa(module):
            seen.add(id(module))
            found.append((path, module))
    return found
