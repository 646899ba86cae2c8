"""Greedy decoding steps through an engine of a cached export, the cache kept on the GPU.

    >>> steps = CachedEngineSteps(EngineRunner("model.engine"))
    >>> logits = steps.step({"input_ids": ids, "attention_mask": mask, "position_ids": pos})  # prefill
    >>> logits = steps.step({"input_ids": next_ids, "attention_mask": wider_mask, ...})       # decode

Every tensor is bound by its graph name (the cache's contract, attn_export/cache_contract.py:
the tokens and the past in, the logits and the presents out), whatever the nodes inside look like. Per step: each input's
shape is set (``IExecutionContext.set_input_shape``), the outputs' shapes read back
(``get_tensor_shape``) and allocated as torch tensors on the device, every address bound
(``set_tensor_address``) and the engine enqueued (``execute_async_v3``) on the current stream.
The presents of a step become the past of the next without leaving the device. A step whose
attention mask is as wide as its input_ids is a prefill: the past starts empty (length 0).

TensorRT wants a non-null address for every input, also an empty one, and PyTorch gives a
zero-element tensor the address 0: an empty past is bound to a small buffer of its own.

The runner is anything with EngineRunner's ``inputs``, ``outputs``, ``dtypes``, ``profile`` and
``context`` (tests pass a stand-in whose context reads and writes memory at the bound addresses).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from attn_export import cache_contract as _contract
from attn_export._moved import moved
from attn_export.cache_contract import TOKEN_INPUTS, CacheContract
from attn_export.errors import InputError
from attn_export.tensorrt.runtime import EngineError

# TensorRT's alignment for bound addresses (IExecutionContext::setTensorAddress).
ALIGNMENT = 256


def cache_pairs(inputs, outputs) -> Dict[str, str]:
    """present output -> past input, every past input with its present; EngineError otherwise.
    By name alone (CacheContract.past_of): an engine carries no metadata."""
    pasts = [n for n in inputs if CacheContract.is_past(n)]
    presents = {n: CacheContract.past_of(n) for n in outputs if CacheContract.is_present(n)}
    unmatched = sorted(set(pasts) ^ set(presents.values()))
    if not pasts or unmatched:
        raise EngineError("the engine is no cached export: " + (
            f"past/present without a partner: {', '.join(unmatched)}" if unmatched else
            f"it has no {_contract.PAST_ROLE}.* inputs (export with --with-past)"))
    return presents


class CachedEngineSteps:
    """One generation at a time through an engine runner (module doc); ``name`` is the backend."""

    name = "tensorrt"

    def __init__(self, runner) -> None:
        """``runner``: an EngineRunner (or its stand-in, whose ``device`` may be the CPU)."""
        self.runner = runner
        self.device = torch.device(getattr(runner, "device", "cuda"))
        self.presents = cache_pairs(runner.inputs, runner.outputs)
        unknown = [n for n in runner.inputs if not CacheContract.is_past(n) and n not in TOKEN_INPUTS]
        if unknown:
            raise EngineError(f"the engine takes input(s) {', '.join(unknown)} that a generation step does not feed")
        self._placeholder = torch.zeros(ALIGNMENT, dtype=torch.uint8, device=self.device)
        self.past: Dict[str, torch.Tensor] = {}

    def past_length(self) -> Optional[int]:
        return next(iter(self.past.values())).shape[2] if self.past else None

    def step(self, feed: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The step's outputs other than the presents (``logits``), on the CPU; the presents
        are kept as the next step's past."""
        tensors = self._inputs(feed)
        why = self.runner.profile.outside({n: tuple(t.shape) for n, t in tensors.items()})
        if why:
            raise InputError(f"{why}: rebuild the engine for longer contexts (--max-context, --max-shapes)")
        context = self.runner.context
        for name in self.runner.inputs:
            t = tensors[name]
            if not context.set_input_shape(name, tuple(t.shape)):
                raise EngineError(f"TensorRT refused shape {list(t.shape)} for input {name}")
            context.set_tensor_address(name, self._address(t))
        outputs = {}
        for name in self.runner.outputs:
            shape = tuple(context.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise EngineError(f"output {name} has an unresolved shape {list(shape)}")
            outputs[name] = torch.empty(shape, dtype=self.runner.dtypes[name], device=self.device)
            context.set_tensor_address(name, self._address(outputs[name]))
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if cuda else None
        if not context.execute_async_v3(stream.cuda_stream if cuda else 0):
            errors = getattr(getattr(self.runner, "_logger", None), "errors", [])
            raise EngineError("TensorRT failed to run the engine: " + ("; ".join(errors[-3:]) or "no reason given"))
        if cuda:
            stream.synchronize()
        self.past = {self.presents[n]: t for n, t in outputs.items() if n in self.presents}
        return {n: t.cpu() for n, t in outputs.items() if n not in self.presents}

    def _inputs(self, feed: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The step's tokens on the device in the engine's types, and the past: empty for a
        prefill, else the last step's presents, whose length the mask must account for."""
        missing = [n for n in self.runner.inputs if n in TOKEN_INPUTS and n not in feed]
        if missing:
            raise InputError(f"the engine needs input(s) {', '.join(missing)}")
        tokens = {n: feed[n].to(device=self.device, dtype=self.runner.dtypes[n]).contiguous()
                  for n in self.runner.inputs if n in TOKEN_INPUTS}
        batch, new = tokens["input_ids"].shape
        past = tokens["attention_mask"].shape[1] - new
        if past == 0:
            self.past = {name: self._empty(name, batch) for name in self.presents.values()}
        elif past != self.past_length():
            raise InputError(f"the attention mask covers {past} past token(s) but the cache holds "
                             f"{self.past_length() or 0}: feed the steps in order, starting with a prefill")
        return {**tokens, **self.past}

    def _empty(self, name: str, batch: int) -> torch.Tensor:
        """An empty past [batch, kv_heads, 0, head_dim]; heads and head_dim from the profile."""
        dims = self.runner.profile.shapes[name][0]
        return torch.empty((batch, dims[1], 0, dims[3]), dtype=self.runner.dtypes[name], device=self.device)

    def _address(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self._placeholder.data_ptr()


# Before the contract had a module of its own (cache_contract.py) the names were spelled here.
_MOVED = {"PAST_PREFIX": ("attn_export.cache_contract.CacheContract.is_past", lambda: _contract.PAST_ROLE + "."),
          "PRESENT_PREFIX": ("attn_export.cache_contract.CacheContract.is_present",
                             lambda: _contract.PRESENT_ROLE + "."),
          "past_name": ("attn_export.cache_contract.CacheContract.past_of", lambda: CacheContract.past_of)}


__getattr__ = moved(__name__, _MOVED)
