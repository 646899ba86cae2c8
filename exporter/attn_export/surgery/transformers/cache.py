"""A transformers decoder with its key/value cache as flat tensors: the module that the cached
export traces (``--with-past``), under the names of the cache's contract
(attn_export/cache_contract.py).

    >>> wrapped = DecoderWithPast.wrap(model)          # checks that model is a decoder-only causal LM
    >>> inputs = wrapped.example_inputs({"input_ids": ids, "attention_mask": mask})
    >>> out = wrapped(**inputs)                         # {"logits": ..., <each present>: ...}

Its inputs and outputs are the contract's (``wrapped.contract.input_names()`` /
``output_names()``): the tokens, the mask over past + new tokens, the positions where the model
takes them and the past of every layer in; the logits and the presents out. One graph serves
prefill (past length 0) and decode.

The cache is rebuilt from the flat tensors in every call (``DynamicCache.update`` per layer),
so the model's own code appends the new keys and values: the exported Concat is the model's.
Every layer keeps its whole past, also under a sliding window (the operator's window applies it).
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Mapping

import torch
from torch import nn

from attn_export import cache_contract as _contract
from attn_export._moved import moved
from attn_export.cache_contract import CacheContract, positions
from attn_export.errors import InputError
from attn_export.surgery.transformers.compat import _transformers, is_hf_model

# torch.export specializes sizes 0 and 1: the example past is traced at this length.
TRACE_PAST_LENGTH = 3


def check_decoder(model: nn.Module) -> None:
    """InputError unless ``model`` is a transformers decoder-only causal LM (the cached export's
    scope), naming what to do instead."""
    if not is_hf_model(model):
        raise InputError(f"--with-past exports a transformers decoder-only causal LM (e.g. AutoModelForCausalLM); "
                         f"{type(model).__name__} is not a transformers model: export it without --with-past")
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise InputError(f"--with-past: {type(model).__name__} is an encoder-decoder; DecoderWithPast wraps "
                         "decoder-only causal LMs (seq2seq_cache.Seq2SeqDecoderWithPast wraps an encoder-decoder)")
    params = inspect.signature(model.forward).parameters
    if not model.can_generate() or not ({"cache", "past_key_values"} & set(params)) or "input_ids" not in params:
        raise InputError(f"--with-past: {type(model).__name__} does not generate text with a key/value cache (load a "
                         "causal LM class, e.g. --model transformers:AutoModelForCausalLM), or export it without "
                         "--with-past")


class FlatCacheModule(nn.Module):
    """A transformers model called with its cache as flat tensors: the model, the contract that
    names them, and the keyword its ``forward`` takes the cache by (``cache`` or
    ``past_key_values``, by version)."""

    def __init__(self, model: nn.Module, contract: CacheContract):
        super().__init__()
        self.model = model
        self.contract = contract
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @classmethod
    def wrap(cls, model: nn.Module, dtype: str = "fp32"):
        """``model`` wrapped, once ``cls.check`` has taken it; its contract from ``cls.contract_of``."""
        cls.check(model)
        return cls(model, cls.contract_of(model, dtype))

    def _check_past(self, past: Mapping[str, torch.Tensor]) -> None:
        """InputError unless ``past`` holds exactly the contract's past inputs."""
        names = self.contract.past_names()
        missing = [n for n in names if n not in past]
        unknown = [n for n in past if n not in names]
        if missing or unknown:
            raise InputError(f"the cached decoder takes {', '.join(names)}; "
                             + (f"missing {', '.join(missing)}" if missing else f"unknown {', '.join(unknown)}"))


class DecoderWithPast(FlatCacheModule):
    """``model`` (a decoder-only causal LM) called with its cache as flat tensors (module doc)."""

    @property
    def geometry(self) -> CacheContract:
        """The contract (its name before it named the cache's inputs and outputs too)."""
        return self.contract

    check = staticmethod(check_decoder)
    contract_of = staticmethod(lambda model, dtype: _contract_of(model, dtype))  # defined below

    def forward(self, input_ids, attention_mask, position_ids=None, **past):
        self._check_past(past)
        names = self.contract.past_names()
        _check_lengths(input_ids, attention_mask, past[names[0]])
        cache = _full_cache()
        for i in range(self.contract.num_layers):
            keys, values = (past[name] for name in self.contract.layer_past_names(i))
            cache.update(keys, values, i)
        kwargs = {"position_ids": position_ids} if position_ids is not None else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, return_dict=True,
                         **{self._cache_kwarg: cache}, **kwargs)
        result = {_contract.LOGITS: out.logits}
        # The cache given is updated in place (the output's name for it differs between versions).
        for i, tensors in enumerate(cache_tensors(cache)):
            result.update({self.contract.present_name(i, slot): t for slot, t in zip(self.contract.slots, tensors)})
        return result

    def example_inputs(self, inputs: Mapping[str, torch.Tensor], past_length: int = TRACE_PAST_LENGTH,
                       seed: int = 0) -> Dict[str, torch.Tensor]:
        """The flat inputs for ``inputs`` (``input_ids`` [B, S], optionally ``attention_mask``
        [B, S] over those tokens) continuing a past of ``past_length`` tokens: random keys and
        values, the mask extended over the past with each row's padding moved first (a left-padded
        prompt's cache), the positions counted from the mask."""
        ids = inputs.get(_contract.INPUT_IDS)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise InputError("--with-past needs input_ids [batch, sequence] among the example inputs")
        unknown = sorted(set(inputs) - {_contract.INPUT_IDS, _contract.ATTENTION_MASK})
        if unknown:
            raise InputError(f"--with-past builds its own inputs from input_ids and attention_mask; drop "
                             f"{', '.join(unknown)}")
        batch, seq = ids.shape
        mask = inputs.get(_contract.ATTENTION_MASK)
        mask = torch.ones(batch, seq, dtype=torch.int64) if mask is None else mask.to(torch.int64)
        mask = torch.cat([torch.ones(batch, past_length, dtype=torch.int64), mask], dim=1)
        # Each row's padding first, as a left-padded prompt's cache holds it: valid past tokens
        # before padded new ones would be a mask with holes, which generation never makes (and
        # where Bloom's ALiBi, counted over the valid keys, is no per-head slope: its route runs
        # such calls on the stock module).
        mask = mask.sort(dim=1, stable=True).values
        out = {_contract.INPUT_IDS: ids, _contract.ATTENTION_MASK: mask}
        if self.contract.position_ids:
            out[_contract.POSITION_IDS] = positions(mask, seq)
        gen = torch.Generator().manual_seed(seed)
        dtype = next(self.model.parameters()).dtype
        shape = (batch, self.contract.num_kv_heads, past_length, self.contract.head_dim)
        out.update({name: torch.randn(shape, generator=gen).to(dtype) for name in self.contract.past_names()})
        return out


def _check_lengths(input_ids, attention_mask, past) -> None:
    """InputError when the mask does not cover past + new tokens (in eager runs: a trace's
    symbolic sizes are left to the model's own guards)."""
    sizes = (input_ids.shape[1], attention_mask.shape[1], past.shape[2])
    if all(isinstance(s, int) for s in sizes) and sizes[1] != sizes[0] + sizes[2]:
        raise InputError(f"attention_mask covers {sizes[1]} positions; the past ({sizes[2]}) and the new tokens "
                         f"({sizes[0]}) are {sizes[0] + sizes[2]}: give the mask over past + new tokens")


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


def _contract_of(model: nn.Module, dtype: str) -> CacheContract:
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
    return CacheContract(num_layers=len(layers), num_kv_heads=int(heads), head_dim=int(head_dim),
                         position_ids=_contract.POSITION_IDS in params, dtype=dtype)


def traced_name(name: str) -> str:
    """The Python name of a contract input in the module torch.export traces (no dots)."""
    return name.replace(".", "_")


def for_tracing(wrapped: DecoderWithPast) -> DecoderWithPast:
    """The same module with a ``forward`` whose parameters are the inputs' names
    (:func:`traced_name`): torch.export binds its inputs and dynamic shapes by parameter name,
    and a ``**past`` parameter would be one nested input, not one graph input per tensor. Any
    wrapper of a model and its contract (an encoder-decoder's decoder too)."""
    names = wrapped.contract.input_names()
    traced = {traced_name(n): n for n in names}
    base = type(wrapped)

    def forward(self, *args, **kwargs):
        given = dict(zip(traced, args))
        given.update(kwargs)
        return base.forward(self, **{traced.get(k, k): v for k, v in given.items()})

    Parameter = inspect.Parameter
    forward.__signature__ = inspect.Signature(
        [Parameter("self", Parameter.POSITIONAL_OR_KEYWORD)]
        + [Parameter(n, Parameter.POSITIONAL_OR_KEYWORD) for n in traced])
    cls = type(base.__name__ + "Traced", (base,), {"forward": forward})
    return cls(wrapped.model, wrapped.contract)


def _empty_past(contract: CacheContract, batch: int, dtype=torch.float32) -> Dict[str, torch.Tensor]:
    return contract.empty_past(batch, dtype)


# The names this module gave before the contract had a module of its own (cache_contract.py).
_NEW = "attn_export.cache_contract."
_MOVED = {"CacheGeometry": (_NEW + "CacheContract", lambda: CacheContract),
          "KINDS": (_NEW + "SLOTS", lambda: _contract.SLOTS),
          "PAST": (_NEW + "CacheContract.past_name",
                   lambda: _contract.cache_name(_contract.PAST_ROLE, "{layer}", "{kind}")),
          "PRESENT": (_NEW + "CacheContract.present_name",
                      lambda: _contract.cache_name(_contract.PRESENT_ROLE, "{layer}", "{kind}")),
          "empty_past": (_NEW + "CacheContract.empty_past", lambda: _empty_past),
          **{name: (_NEW + name, lambda name=name: getattr(_contract, name))
             for name in ("BATCH", "SEQUENCE", "PAST_SEQUENCE", "TOTAL_SEQUENCE")}}

__getattr__ = moved(__name__, _MOVED)
