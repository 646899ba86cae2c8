"""Capture the attention weights a model computes while it runs: one array per attention site
and call, taken from the model's own computation.

    >>> with AttentionCapture(model, batch_index=0) as capture:
    ...     model(**inputs)
    >>> capture.weights        # {"encoder.layers.0.self_attn": Tensor[H, Lq, Lk], ...}

Where the weights come from, per form of attention:

* ``nn.MultiheadAttention`` and :class:`~attn_export.FusedMultiheadAttention`: the layer's own
  ``need_weights`` output. A forward pre-hook asks the layer for per-head weights
  (``need_weights=True, average_attn_weights=False``) whatever its caller asked, and a forward
  hook records them and hands the caller what it asked for (``None``, or the head average).
* ``F.scaled_dot_product_attention`` calls (the SDPA forms, transformers' ``sdpa`` attention) and
  calls of the fused core operator ``attn_export::attention`` (the SDPA route, routed transformers
  layers): neither returns its weights, so a torch function mode takes the call's own query, key,
  masks, causality, scale and cap as the call received them and evaluates the softmax the call
  evaluates, in each call's own mask convention (SDPA: ``True`` = attend; the operator: ``True`` =
  masked). A call is attributed to the innermost module running it (``path#2`` for its second
  call).

PyTorch's native MHA fast paths are off meanwhile: they would bypass the layers' ``forward``.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from attn_export.ops.module import FusedMultiheadAttention, StockMultiheadAttention, masked_softmax

# nn.MultiheadAttention.forward's parameters after (query, key, value), in order.
_MHA_PARAMETERS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
                   "average_attn_weights", "is_causal")


def _op_weights(query, key, value=None, attn_mask=None, key_padding_mask=None, is_causal=False, scale=None,
                softcap=None) -> torch.Tensor:
    """softmax of one ``attn_export::attention`` call: ``True`` (or ``-inf``) masks a pair; a
    query that sees no key gets zeros, as the operator's output does."""
    q, k = query.detach().float(), key.detach().float()
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return masked_softmax(scores, attn_mask, key_padding_mask, is_causal)


def _sdpa_weights(query, key, value=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False) -> torch.Tensor:
    """softmax of one ``F.scaled_dot_product_attention`` call (PyTorch's documented reference:
    boolean ``True`` = may attend, causal lower-triangular); a query that sees no key is NaN,
    as SDPA's math is."""
    q, k = query.detach().float(), key.detach().float()
    if q.dim() == 3:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
        attn_mask = attn_mask.unsqueeze(1) if attn_mask is not None and attn_mask.dim() == 3 else attn_mask
    if k.size(1) != q.size(1):  # grouped-query heads (enable_gqa): each key head serves a group
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    lq, lk = scores.shape[-2:]
    if is_causal:
        scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), -math.inf)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.float()
    return torch.softmax(scores, dim=-1)


_SDPA_CALLS = {F.scaled_dot_product_attention: _sdpa_weights}


def _call_weights(func):
    if func in _SDPA_CALLS:
        return _SDPA_CALLS[func]
    if func is torch.ops.attn_export.attention.default:
        return _op_weights
    return None


class _CallCapture(TorchFunctionMode):
    """Records the weights of the attention calls the model makes (see the module docstring)."""

    def __init__(self, capture: "AttentionCapture") -> None:
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weights_of = _call_weights(func)
        if weights_of is not None and not self.capture._inside_layer:
            self.capture._record_call(weights_of(*args, **kwargs))
        return func(*args, **kwargs)


class AttentionCapture:
    """A context manager recording the attention weights of ``model``'s forward calls into
    ``weights``: site path -> ``Tensor[H, Lq, Lk]`` (float32, the ``batch_index``-th batch
    element). A site that runs twice keeps its last call."""

    def __init__(self, model: nn.Module, batch_index: int = 0) -> None:
        self.model = model
        self.batch_index = batch_index
        self.weights: Dict[str, torch.Tensor] = {}
        self._handles: List = []
        self._stack: List[str] = []  # paths of the modules running now, innermost last
        self._calls: Dict[str, int] = {}
        self._inside_layer = 0
        self._asked: List[tuple] = []
        self._mode: Optional[_CallCapture] = None

    def __enter__(self) -> "AttentionCapture":
        for path, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter_module(path)))
            self._handles.append(module.register_forward_hook(self._leave_module))
            if isinstance(module, (StockMultiheadAttention, FusedMultiheadAttention)):
                self._handles.append(module.register_forward_pre_hook(self._ask_for_weights, with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._take_weights(path), with_kwargs=True))
        self._fast_path = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        self._mode = _CallCapture(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        torch.backends.mha.set_fastpath_enabled(self._fast_path)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- module paths, for calls ---------------------------------------------------------------

    def _enter_module(self, path: str):
        def hook(_module, _args):
            self._stack.append(path)

        return hook

    def _leave_module(self, _module, _args, _output):
        self._stack.pop()

    def _record_call(self, weights: torch.Tensor) -> None:
        where = self._stack[-1] if self._stack else ""
        self._calls[where] = self._calls.get(where, 0) + 1
        number = self._calls[where]
        self._keep(where if number == 1 else f"{where}#{number}", weights)

    def _keep(self, path: str, weights: torch.Tensor) -> None:
        if weights.dim() == 3:  # unbatched
            weights = weights.unsqueeze(0)
        if not -weights.size(0) <= self.batch_index < weights.size(0):
            from attn_export.errors import InputError

            raise InputError(f"batch index {self.batch_index} is out of range: {path} ran a batch of "
                             f"{weights.size(0)}")
        self.weights[path] = weights[self.batch_index].detach().float().cpu()

    # -- nn.MultiheadAttention-style layers ----------------------------------------------------

    def _ask_for_weights(self, _module, args, kwargs):
        kwargs = {**dict(zip(_MHA_PARAMETERS, args)), **kwargs}
        self._asked.append((kwargs.get("need_weights", True), kwargs.get("average_attn_weights", True)))
        self._inside_layer += 1
        kwargs.update(need_weights=True, average_attn_weights=False)
        return (), kwargs

    def _take_weights(self, path: str):
        def hook(_module, _args, _kwargs, output):
            self._inside_layer -= 1
            need, average = self._asked.pop()
            attn_output, weights = output
            self._keep(path, weights)
            if not need:
                return attn_output, None
            return attn_output, (weights.mean(dim=-3) if average else weights)

        return hook
