"""The cached export: a decoder exported with its key/value cache, one graph for prefill (past
length 0) and decode, under the names and axes of the cache's contract
(attn_export/cache_contract.py; docs/huggingface.md, "Exports with the cache").

The module traced is :class:`attn_export.surgery.transformers.cache.DecoderWithPast` with a
forward of plain parameter names (the contract's names without dots); the graph's inputs get the
contract's names after the capture, its outputs have them from the start (the wrapper's output
keys). The example past is traced at a length of at least 2 (sizes 0 and 1 would be
specialized) and the axes are the contract's: one ``batch``, ``sequence`` (input_ids,
position_ids), ``past_sequence`` (every past tensor, one named Dim) and ``total_sequence``
(attention_mask); the presents' length comes out as the trace computes it. The model's
Concat(past, new) is folded into the attention nodes after the capture: the custom node's cache
form (onnx/custom_past.py) or opset-23 Attention's past inputs (onnx/standard_past.py). The
contract goes into the file's metadata (CacheContract.to_metadata).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

import onnx
import torch
from torch import nn

from attn_export import cache_contract as _contract
from attn_export._moved import moved
from attn_export.cache_contract import CacheContract
from attn_export.errors import InputError
from attn_export.onnx.graph import _rename_symbols
from attn_export.surgery.transformers import cache as _cache
from attn_export.surgery.transformers import seq2seq_cache as _seq2seq


@dataclass
class CachedExport:
    module: nn.Module  # what torch.export traces: plain parameter names
    inputs: Dict[str, torch.Tensor]  # by plain name
    axes: Dict[str, Dict[int, str]]  # by plain name
    contract: CacheContract

    @property
    def contract_names(self) -> Dict[str, str]:
        """plain name -> the graph input's name."""
        return {_cache.traced_name(n): n for n in self.contract.input_names()}


def check_request(model: nn.Module, dynamic_axes: Optional[Mapping]) -> None:
    """InputError, before anything is copied or run, for a model that is no decoder-only causal
    LM and for dynamic axes given with the cache (the contract's are the export's)."""
    if is_encoder_decoder(model):
        _seq2seq.check_seq2seq(model)
    else:
        _cache.check_decoder(model)
    if dynamic_axes is not None:
        raise InputError(f"--with-past sets the cached export's own dynamic axes ({', '.join(_contract.AXES)}): "
                         "drop --dynamic/--static")


def prepare(work: nn.Module, example_inputs: Mapping[str, torch.Tensor], seed: int) -> CachedExport:
    """The traced module, its example inputs (a past of ``TRACE_PAST_LENGTH`` tokens after the
    example's) and the contract's axes, for the working copy ``work`` (already in its dtype,
    which the past and the metadata take)."""
    wrapper = _seq2seq.Seq2SeqDecoderWithPast if is_encoder_decoder(work) else _cache.DecoderWithPast
    wrapped = wrapper.wrap(work, dtype_name(work))
    inputs = wrapped.example_inputs(example_inputs, seed=seed)
    ids = inputs[_contract.INPUT_IDS]
    if ids.shape[1] < 2 and not wrapped.contract.encoder_decoder:
        # A new-token length of 1 would be specialized: trace a prefill of 2 tokens after the past.
        extended = {_contract.INPUT_IDS: ids.repeat(1, 2)}
        inputs = wrapped.example_inputs(extended, seed=seed)
    plain = {_cache.traced_name(n): t for n, t in inputs.items()}
    axes = {_cache.traced_name(n): d for n, d in wrapped.contract.dynamic_axes().items()}
    return CachedExport(_cache.for_tracing(wrapped), plain, axes, wrapped.contract)


def is_encoder_decoder(model: nn.Module) -> bool:
    """An encoder-decoder: its cached export is a pair of files (onnx/seq2seq.py)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def dtype_name(model: nn.Module) -> str:
    """The export dtype's name (``fp32``, ``fp16``, ``bf16``) of the model's floating parameters."""
    dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point), torch.float32)
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    if dtype not in names:
        raise InputError(f"--with-past: the model's parameters are {dtype}; export with --dtype fp32, fp16 or bf16")
    return names[dtype]


def rename_inputs(proto: onnx.ModelProto, names: Mapping[str, str]) -> None:
    """Gives the graph inputs their contract names, wherever the graph reads them."""
    for value in list(proto.graph.input) + list(proto.graph.value_info):
        value.name = names.get(value.name, value.name)
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in names:
                node.input[i] = names[name]


def unify_symbols(proto: onnx.ModelProto, axes: Mapping[str, Mapping[int, str]]) -> None:
    """One symbol per label: torch.export can keep a symbol per input for one named Dim (the
    past tensors' lengths, proven equal only by its guards); the first input's stands for all."""
    first: Dict[str, str] = {}
    mapping: Dict[str, str] = {}
    dims = {v.name: v.type.tensor_type.shape.dim for v in proto.graph.input}
    for name, labels in axes.items():
        for axis, label in labels.items():
            dim = dims[name][axis]
            if not dim.HasField("dim_param") or not dim.dim_param.isidentifier():
                continue
            owner = first.setdefault(label, dim.dim_param)
            if dim.dim_param != owner:
                mapping[dim.dim_param] = owner
    _rename_symbols(proto, mapping)


def _for_validation(model: nn.Module, inputs, dtype: str, seed: int = 0):
    from attn_export.validation.generation_gate import wrapped_decoder

    wrapped, checked, _note = wrapped_decoder(model, inputs, dtype, seed)
    return wrapped, checked


def _file_geometry(onnx_path) -> Optional[dict]:
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - the gate's own load says what is wrong with the file
        return None
    contract = CacheContract.from_metadata(model)
    return contract.to_dict() if contract is not None else None


# What this module gave before the contract (cache_contract.py) and the gate's choice of how a
# cached export is checked (cache_contract.generates, validation/generation_gate.py) moved.
_MOVED = {"META_KEY": ("attn_export.cache_contract.METADATA_KEY", lambda: _contract.METADATA_KEY),
          "generates": ("attn_export.cache_contract.generates", lambda: _contract.generates),
          "for_validation": ("attn_export.validation.generation_gate.wrapped_decoder", lambda: _for_validation),
          "file_geometry": ("attn_export.cache_contract.CacheContract.from_metadata", lambda: _file_geometry)}


__getattr__ = moved(__name__, _MOVED)
