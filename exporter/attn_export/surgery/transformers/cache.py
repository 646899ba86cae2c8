"""A transformers decoder with its key/value cache as flat tensors: the module that
``export_onnx(..., with_past=True)`` exports, with Optimum's names.

    >>> wrapped = DecoderWithPast.wrap(model)          # checks that model is a decoder-only causal LM
    >>> inputs = wrapped.example_inputs({"input_ids": ids, "attention_mask": mask})
    >>> out = wrapped(**inputs)                         # {"logits": ..., "present.0.key": ..., ...}

Inputs: ``input_ids`` [batch, sequence], ``attention_mask`` [batch, past_sequence + sequence]
(1 = token, 0 = padding), ``position_ids`` [batch, sequence] where the model takes them,
``past_key_values.{i}.key`` / ``.value`` [batch, num_kv_heads, past_sequence, head_dim].
Outputs: ``logits`` then ``present.{i}.key`` / ``.value`` [batch, num_kv_heads,
past_sequence + sequence, head_dim]. One graph serves prefill (past length 0) and decode.

The cache is rebuilt from the flat tensors in every call (``DynamicCache.update`` per layer),
so the model's own code appends the new keys and values: the exported Concat is the model's.
Every layer keeps its whole past, also under a sliding window (the operator's window applies it).
"""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping

import torch
from torch import nn

from attn_export.errors import InputError
from attn_export.surgery.transformers.compat import _transformers, is_hf_model

PAST = "past_key_values.{layer}.{kind}"
PRESENT = "present.{layer}.{kind}"
KINDS = ("key", "value")
# Axis labels of the cached export (attn_export.onnx.dims reads them as declared axes).
BATCH, SEQUENCE, PAST_SEQUENCE, TOTAL_SEQUENCE = "batch", "sequence", "past_sequence", "total_sequence"
# torch.export specializes sizes 0 and 1: the example past is traced at this length.
TRACE_PAST_LENGTH = 3


@dataclass(frozen=True)
class CacheGeometry:
    """What a runtime needs to build an empty past: the metadata property ``attn_export.with_past``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    position_ids: bool  # the graph takes position_ids
    dtype: str = "fp32"

    def to_dict(self) -> dict:
        return asdict(self)

    def past_names(self) -> List[str]:
        return [PAST.format(layer=i, kind=k) for i in range(self.num_layers) for k in KINDS]

    def present_names(self) -> List[str]:
        return [PRESENT.format(layer=i, kind=k) for i in range(self.num_layers) for k in KINDS]

    def input_names(self) -> List[str]:
        return ["input_ids", "attention_mask"] + (["position_ids"] if self.position_ids else []) + self.past_names()

    def dynamic_axes(self) -> Dict[str, Dict[int, str]]:
        axes = {"input_ids": {0: BATCH, 1: SEQUENCE}, "attention_mask": {0: BATCH, 1: TOTAL_SEQUENCE}}
        if self.position_ids:
            axes["position_ids"] = {0: BATCH, 1: SEQUENCE}
        axes.update({name: {0: BATCH, 2: PAST_SEQUENCE} for name in self.past_names()})
        return axes


def check_decoder(model: nn.Module) -> None:
    """InputError unless ``model`` is a transformers decoder-only causal LM (the cached export's
    scope), naming what to do instead."""
    if not is_hf_model(model):
        raise InputError(f"--with-past exports a transformers decoder-only causal LM (e.g. AutoModelForCausalLM); "
                         f"{type(model).__name__} is not a transformers model: export it without --with-past")
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise InputError(f"--with-past: {type(model).__name__} is an encoder-decoder; only decoder-only causal LMs "
                         "are exported with their cache: export it without --with-past")
    params = inspect.signature(model.forward).parameters
    if not model.can_generate() or not ({"cache", "past_key_values"} & set(params)) or "input_ids" not in params:
        raise InputError(f"--with-past: {type(model).__name__} does not generate text with a key/value cache (load a "
                         "causal LM class, e.g. --model transformers:AutoModelForCausalLM), or export it without "
                         "--with-past")


class DecoderWithPast(nn.Module):
    """``model`` (a decoder-only causal LM) called with its cache as flat tensors (module doc)."""

    def __init__(self, model: nn.Module, geometry: CacheGeometry):
        super().__init__()
        self.model = model
        self.geometry = geometry
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @classmethod
    def wrap(cls, model: nn.Module, dtype: str = "fp32") -> "DecoderWithPast":
        check_decoder(model)
        return cls(model, _geometry(model, dtype))

    def forward(self, input_ids, attention_mask, position_ids=None, **past):
        names = self.geometry.past_names()
        missing = [n for n in names if n not in past]
        unknown = [n for n in past if n not in names]
        if missing or unknown:
            raise InputError(f"the cached decoder takes {', '.join(names)}; "
                             + (f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(unknown)}"))
        _check_lengths(input_ids, attention_mask, past[names[0]])
        cache = _full_cache()
        for i in range(self.geometry.num_layers):
            cache.update(past[PAST.format(layer=i, kind="key")], past[PAST.format(layer=i, kind="value")], i)
        kwargs = {"position_ids": position_ids} if position_ids is not None else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, return_dict=True,
                         **{self._cache_kwarg: cache}, **kwargs)
        result = {"logits": out.logits}
        # The cache given is updated in place (the output's name for it differs between versions).
        for i, (keys, values) in enumerate(cache_tensors(cache)):
            result[PRESENT.format(layer=i, kind="key")] = keys
            result[PRESENT.format(layer=i, kind="value")] = values
        return result

    def example_inputs(self, inputs: Mapping[str, torch.Tensor], past_length: int = TRACE_PAST_LENGTH,
                       seed: int = 0) -> Dict[str, torch.Tensor]:
        """The flat inputs for ``inputs`` (``input_ids`` [B, S], optionally ``attention_mask``
        [B, S] over those tokens) continuing a past of ``past_length`` valid tokens: random
        keys and values, the mask extended over the past, the positions counted from the mask."""
        ids = inputs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise InputError("--with-past needs input_ids [batch, sequence] among the example inputs")
        unknown = sorted(set(inputs) - {"input_ids", "attention_mask"})
        if unknown:
            raise InputError(f"--with-past builds its own inputs from input_ids and attention_mask; drop "
                             f"{', '.join(unknown)}")
        batch, seq = ids.shape
        mask = inputs.get("attention_mask")
        mask = torch.ones(batch, seq, dtype=torch.int64) if mask is None else mask.to(torch.int64)
        mask = torch.cat([torch.ones(batch, past_length, dtype=torch.int64), mask], dim=1)
        out = {"input_ids": ids, "attention_mask": mask}
        if self.geometry.position_ids:
            out["position_ids"] = positions(mask, seq)
        gen = torch.Generator().manual_seed(seed)
        dtype = next(self.model.parameters()).dtype
        shape = (batch, self.geometry.num_kv_heads, past_length, self.geometry.head_dim)
        out.update({name: torch.randn(shape, generator=gen).to(dtype) for name in self.geometry.past_names()})
        return out


def _check_lengths(input_ids, attention_mask, past) -> None:
    """InputError when the mask does not cover past + new tokens (in eager runs: a trace's
    symbolic sizes are left to the model's own guards)."""
    sizes = (input_ids.shape[1], attention_mask.shape[1], past.shape[2])
    if all(isinstance(s, int) for s in sizes) and sizes[1] != sizes[0] + sizes[2]:
        raise InputError(f"attention_mask covers {sizes[1]} positions; the past ({sizes[2]}) and the new tokens "
                         f"({sizes[0]}) are {sizes[0] + sizes[2]}: give the mask over past + new tokens")


def positions(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``position_ids`` of the last ``new_tokens`` tokens, as transformers' ``generate()`` counts
    them from a left-padded mask: ``cumsum(mask) - 1`` clipped at 0. A contiguous tensor (a view
    of a longer one would carry the longer length into torch.export's guards)."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return pos[:, pos.shape[1] - new_tokens:].contiguous()


def empty_past(geometry: CacheGeometry, batch: int, dtype=torch.float32) -> Dict[str, torch.Tensor]:
    """The past of a prefill: every ``past_key_values.*`` of length 0."""
    shape = (batch, geometry.num_kv_heads, 0, geometry.head_dim)
    return {name: torch.zeros(shape, dtype=dtype) for name in geometry.past_names()}


def cache_tensors(cache) -> List[tuple]:
    """(keys, values) per layer of a transformers cache (``layers`` from 4.56, lists before)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _full_cache():
    """A DynamicCache whose every layer keeps the whole past: built from a config, transformers
    gives sliding-window layers (Mistral, Gemma 2) a cache that drops keys beyond the window,
    a length-dependent branch and presents shorter than past + new tokens; with the whole past
    kept, the operator's window (or the model's mask) applies the window (as Optimum's exports do)."""
    from transformers import DynamicCache

    return DynamicCache()


def _geometry(model: nn.Module, dtype: str) -> CacheGeometry:
    """The cache's layout as the model writes it: one prefill of two tokens, its presents' shapes."""
    _transformers()
    params = inspect.signature(model.forward).parameters
    cache = _full_cache()
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 2, dtype=torch.int64), use_cache=True, return_dict=True,
              **{"cache" if "cache" in params else "past_key_values": cache})
    layers = cache_tensors(cache)
    if not layers or any(k.dim() != 4 or v.shape[:3] != k.shape[:3] for k, v in layers):
        raise InputError(f"--with-past: {type(model).__name__}'s cache is not [batch, kv_heads, sequence, head_dim] "
                         "keys and values per layer; export it without --with-past")
    _, heads, _, head_dim = layers[0][0].shape
    if any(k.shape[1] != heads or k.shape[3] != head_dim or v.shape[3] != head_dim for k, v in layers):
        raise InputError(f"--with-past: {type(model).__name__}'s layers differ in key/value heads or head size; "
                         "export it without --with-past")
    return CacheGeometry(num_layers=len(layers), num_kv_heads=int(heads), head_dim=int(head_dim),
                         position_ids="position_ids" in params, dtype=dtype)


def traced_name(name: str) -> str:
    """The Python name of a contract input in the module torch.export traces (no dots)."""
    return name.replace(".", "_")


def for_tracing(wrapped: DecoderWithPast) -> DecoderWithPast:
    """The same module with a ``forward`` whose parameters are the inputs' names
    (:func:`traced_name`): torch.export binds its inputs and dynamic shapes by parameter name,
    and a ``**past`` parameter would be one nested input, not one graph input per tensor."""
    names = wrapped.geometry.input_names()
    traced = {traced_name(n): n for n in names}

    def forward(self, *args, **kwargs):
        given = dict(zip(traced, args))
        given.update(kwargs)
        return DecoderWithPast.forward(self, **{traced.get(k, k): v for k, v in given.items()})

    Parameter = inspect.Parameter
    forward.__signature__ = inspect.Signature(
        [Parameter("self", Parameter.POSITIONAL_OR_KEYWORD)]
        + [Parameter(n, Parameter.POSITIONAL_OR_KEYWORD) for n in traced])
    cls = type("DecoderWithPastTraced", (DecoderWithPast,), {"forward": forward})
    return cls(wrapped.model, wrapped.geometry)
