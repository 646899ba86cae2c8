"""Bloom's and MPT's attention on the operator, their ALiBi bias as the operator's per-head slopes.

Neither family dispatches through transformers' AttentionInterface: each attention module adds
the model's ALiBi tensor to its scores itself. :class:`AlibiForward` is the instance ``forward``
that the ``alibi`` route (:mod:`attn_export.surgery.routes.alibi`) gives such a module: it
computes query, key and value as the module does (Bloom's fused projection and head layout,
MPT's ``clip_qkv``), appends them to the cache as the module does (``cache.update``), and calls
the operator causal, aligned bottom-right, with the module's scale and the model's slopes; then
the module's own output steps (Bloom's ``pretraining_tp`` slices, its dropout and residual).

Why the slopes equal the models' biases: under causal masking a per-row constant added to the
scores leaves the softmax unchanged. Bloom adds ``slope * c(j)``, ``c(j)`` the key's position
counted over the row's non-padded keys; MPT adds ``slope * (j - (Lk - 1))``; the operator adds
``-slope * (i + Lk - Lq - j)`` for the keys a causal query sees. MPT's is the operator's plus a
per-row constant. Bloom's is too wherever a row's valid keys are contiguous (left or right
padding: ``c(j) = j - first valid``); a padding mask with holes between valid keys would count
them differently, which eager calls check (they run the stock module then) and exports cannot.

The models' causal mask (``[B, 1, Lq, Lk]``, built by transformers) is read only for its last
query row, which under causal masking is the padding of the keys: the operator's key-padding
mask. A call whose arguments the operator cannot reproduce (no mask, no ALiBi tensor, attention
weights asked for, dropout in training, eager tensors on a device whose kernels take no slopes:
CUDA's, so far) runs the stock module's forward and is counted as such; a trace (the export) takes
the operator on any device.

The slopes come from transformers' own functions (``build_alibi_tensor`` of Bloom,
``build_mpt_alibi_tensor`` of MPT) evaluated at two positions, so they follow the library.
"""
from __future__ import annotations

import collections
import inspect
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
from torch import nn

_BLOOM = "transformers.models.bloom.modeling_bloom"
_MPT = "transformers.models.mpt.modeling_mpt"


@dataclass(frozen=True)
class Family:
    """One ALiBi architecture: its attention class (by module and name), its heads, its slopes,
    why a module cannot be served (None: it can), and the fused forward."""

    modeling: str
    class_name: str
    heads: Callable[[nn.Module], int]
    slopes: Callable[[nn.Module], List[float]]
    refusal: Callable[[nn.Module], Optional[str]]
    forward: Callable


def family_of(module: nn.Module) -> Optional[Family]:
    """The family whose attention class ``module`` is an instance of (subclasses included), else None."""
    for family in FAMILIES:
        modeling = sys.modules.get(family.modeling)
        cls = getattr(modeling, family.class_name, None) if modeling is not None else None
        if cls is not None and isinstance(module, cls):
            return family
    return None


def overridden(module: nn.Module, family: Family) -> Optional[str]:
    """Why a subclass of the family's class cannot be served: it overrides ``forward``."""
    cls = getattr(sys.modules[family.modeling], family.class_name)
    if type(module).forward is not cls.forward:
        return f"{type(module).__qualname__} overrides {family.class_name}.forward"
    return None


def _two_positions(bias: torch.Tensor) -> List[float]:
    """The slopes of an ALiBi tensor ``[H, 1, 2]`` taken at two consecutive key positions."""
    return [float(x) for x in (bias[:, 0, 1] - bias[:, 0, 0]).to(torch.float64).tolist()]


def _bloom_slopes(module: nn.Module) -> List[float]:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    return _two_positions(build_alibi_tensor(torch.ones(1, 2, dtype=torch.int64), module.num_heads, torch.float32))


def _mpt_slopes(module: nn.Module) -> List[float]:
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    # MptModel calls it with its default alibi_bias_max (not the config's): the same here.
    return _two_positions(build_mpt_alibi_tensor(module.n_heads, 2))


def _bloom_refusal(module: nn.Module) -> Optional[str]:
    if getattr(module, "beta", 1.0) != 1.0:
        return f"its beta={module.beta} scales the ALiBi tensor, which the operator's slopes do not"
    return None


def _mpt_refusal(module: nn.Module) -> Optional[str]:
    return None


class AlibiForward:
    """The instance ``forward`` of a routed Bloom or MPT attention module (module docstring).
    ``calls`` counts what ran since routing: ``"fused"`` and ``"stock: <reason>"``."""

    def __init__(self, module: nn.Module, family: Family, slopes: List[float]):
        self.module = module
        self.family = family
        self.slopes = list(slopes)
        self.calls: collections.Counter = collections.Counter()

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.update(arguments.pop("kwargs", {}))
        reason = _stock_reason(self.module, self.family, arguments)
        if reason is not None:
            self._count(f"stock: {reason}")
            return type(self.module).forward(self.module, *args, **kwargs)
        self._count("fused")
        return self.family.forward(self.module, self.slopes, **arguments)

    def _count(self, key: str) -> None:
        if not torch.compiler.is_compiling():  # a count is no part of a compiled graph
            self.calls[key] += 1

    @property
    def signature(self) -> inspect.Signature:
        """The class forward's, without self (torch.export binds inputs by it)."""
        signature = inspect.signature(type(self.module).forward)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    __signature__ = signature


def _stock_reason(module: nn.Module, family: Family, arguments) -> Optional[str]:
    """Why this call runs the stock module's forward (None: the operator serves it)."""
    mask = arguments.get("attention_mask")
    if arguments.get("output_attentions"):
        return "attention weights asked for (output_attentions=True): the operator returns none"
    if family.modeling == _BLOOM and arguments.get("alibi") is None:
        return "no ALiBi tensor given"
    if family.modeling == _MPT and arguments.get("position_bias") is None:
        return "no ALiBi tensor given (position_bias=None)"
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return ("no 4-D causal mask given (the operator's causality and key padding are read from the model's "
                "causal mask)")
    expected = torch.bool if family.modeling == _MPT else None
    if (expected is not None and mask.dtype != expected) or (expected is None and not mask.dtype.is_floating_point):
        return f"a {mask.dtype} mask where the module takes {'booleans' if expected else 'an additive float mask'}"
    if not _is_tracing(mask) and mask.device.type != "cpu":
        # csrc/ops/cuda/attention_cuda_binding.cu: check_no_alibi (lift this when they take them)
        return f"the operator's ALiBi slopes run on the CPU kernels only, not on {mask.device.type} tensors yet"
    if module.training and _dropout(module) > 0:
        return f"attention dropout {_dropout(module)} in training (dropout is not fused)"
    if family.modeling == _BLOOM and not _is_tracing(mask) and _has_holes(_key_padding(mask)):
        return ("a padding mask with holes between valid keys: Bloom counts key positions over the valid keys, "
                "which the slopes express only for contiguous ones")
    return None


def _dropout(module: nn.Module) -> float:
    value = getattr(module, "attn_dropout_p", None)
    if value is None:
        value = getattr(getattr(module, "attention_dropout", None), "p", 0.0)
    return float(value or 0.0)


def _is_tracing(mask: torch.Tensor) -> bool:
    """Whether the call is being traced (torch.export, torch.compile, torch.jit): the mask's
    values are unknown then (a fake tensor or a proxy), and a check on them would be a guard."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or type(mask) is not torch.Tensor


def _key_padding(mask: torch.Tensor) -> torch.Tensor:
    """``[B, Lk]`` booleans, True = a padded key: the last query row of the causal mask (the last
    query sees every key that is not padding). Bloom's mask is additive (0 = attend), MPT's
    boolean (True = masked)."""
    row = mask[:, 0, -1, :]
    return row if row.dtype == torch.bool else row != 0


def _has_holes(padded: torch.Tensor) -> bool:
    """Whether some row has a padded key between two valid ones."""
    valid = ~padded
    seen = valid.cumsum(-1) > 0
    rest = valid.flip(-1).cumsum(-1).flip(-1) > 0
    return bool((padded & seen & rest).any())


def _attention(query, key, value, mask, scale: float, slopes: List[float]) -> torch.Tensor:
    """The operator, causal bottom-right with the key padding of ``mask`` and the slopes;
    ``[B, Lq, H * D]``."""
    from attn_export.ops.functional import CausalAlignment, attention

    out = attention(query, key, value, key_padding_mask=_key_padding(mask), is_causal=True, scale=scale,
                    causal_alignment=CausalAlignment.BOTTOM_RIGHT, alibi_slopes=slopes)
    batch, heads, length, dim = out.shape
    return out.transpose(1, 2).reshape(batch, length, heads * dim)


def _bloom_forward(module, slopes, hidden_states, residual, alibi, attention_mask, layer_past=None,
                   use_cache=False, output_attentions=False, **kwargs):
    """BloomAttention.forward with the operator in place of baddbmm(alibi), mask, softmax, bmm."""
    from transformers.models.bloom.modeling_bloom import dropout_add

    query, key, value = module._reshape(module.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    context = _attention(query, key, value, attention_mask, module.inv_norm_factor, slopes)
    if module.pretraining_tp > 1 and module.slow_but_exact:  # as the stock module: the dense layer in slices
        slices = module.hidden_size / module.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(module.pretraining_tp):
            part = slice(int(i * slices), int((i + 1) * slices))
            output = output + nn.functional.linear(context[:, :, part], module.dense.weight[:, part])
    else:
        output = module.dense(context)
    return dropout_add(output, residual, module.hidden_dropout, module.training), None


def _mpt_forward(module, slopes, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    """MptAttention.forward with the operator in place of matmul, position_bias, mask, softmax, matmul."""
    batch, length = hidden_states.shape[:2]
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (t.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
                         for t in mixed.chunk(3, dim=2))
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    context = _attention(query, key, value, attention_mask, module.softmax_scale, slopes)
    return module.out_proj(context), None


FAMILIES = (
    Family(_BLOOM, "BloomAttention", lambda m: m.num_heads, _bloom_slopes, _bloom_refusal, _bloom_forward),
    Family(_MPT, "MptAttention", lambda m: m.n_heads, _mpt_slopes, _mpt_refusal, _mpt_forward),
)

__all__ = ["AlibiForward", "FAMILIES", "Family", "family_of", "overridden"]
