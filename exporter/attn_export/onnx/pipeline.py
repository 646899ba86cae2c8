"""``export_onnx``: replace, trace with torch.export (dynamic batch and sequence), translate
with torch's ONNX exporter (onnx/sample.py, onnx/capture.py), finish the graph with the passes
of onnx/passes (label the axes, the flavor, the node's functions, ...), check, write
(onnx/saving.py)."""
from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path
from typing import Dict, Mapping, Optional

import torch
from torch import nn

from attn_export.surgery import transformers as _hf
from attn_export import inputs as _inputs
from attn_export.cache_contract import POSITION_IDS, CacheContract
from attn_export.errors import InputError
from attn_export.onnx import passes as _passes
from attn_export.onnx import seq2seq as _seq2seq
from attn_export.onnx import with_past as _with_past
from attn_export.onnx._moved import moved_names
from attn_export.onnx.capture import capture as _capture
from attn_export.onnx.editing import count_attention_nodes
from attn_export.onnx.metadata import META_PREFIX
from attn_export.onnx.ort import check_model as _check_ort_model
from attn_export.onnx.result import ExportResult
from attn_export.onnx.sample import SampleRun, sample_run as _sample_run
from attn_export.onnx.saving import check_writable as _check_writable, save as _save
from attn_export.options import ExportOptions, with_fields
from attn_export.onnx_options import (  # noqa: F401 - ATTENTION_FLAVORS, FUNCTION_MODES, DEFAULT_OPSET: public here
    ATTENTION_FLAVORS,
    DEFAULT_ATTENTION,
    DEFAULT_FUNCTIONS,
    DEFAULT_OPSET,
    FUNCTION_MODES,
    check_choices,
    export_opset,
)
EXPORT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def export_onnx(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], path: str | Path,
                options: Optional[ExportOptions] = None, **fields) -> ExportResult:
    """Exports ``model`` to ONNX at ``path`` with one ``attn_export.FusedAttention`` node per
    fused attention layer.

    Args:
        model: the model; not modified (a copy is replaced and exported, in eval mode). A
            transformers model is exported without its key/value cache (``use_cache=False``).
        example_inputs: name -> tensor, the names of ``model.forward``'s parameters; they become
            the ONNX graph's input names.
        path: the .onnx file to write (atomically).
        options: what is written (attn_export.options.ExportOptions documents each field:
            opset, dtype, dynamic axes, attention flavor, function mode, with_past, ...);
            ``fields``, its fields as keywords (``dtype="fp16"``), are applied over it.
    """
    options = with_fields(ExportOptions, options, fields, "export_onnx")
    opset, dtype, attention, functions = options.opset, options.dtype, options.attention, options.functions
    dynamic_axes, with_past, replace, seed = options.dynamic_axes, options.with_past, options.replace, options.seed
    quiet = options.quiet
    opset = _check_options(opset, dtype, attention, functions)
    path = Path(path)
    _check_writable(path)
    work, inputs, axes, cached = _working_copy(model, example_inputs, dtype, dynamic_axes, with_past, seed)
    sample = _sample_run(work, inputs, axes, replace, seed)
    proto = _capture(work, sample, axes, opset, quiet)
    if cached is not None:
        inputs, axes = _contract_names(proto, cached, inputs, axes)
    last_logits = options.last_logits or False
    if last_logits and cached.contract.encoder_decoder:
        if last_logits is True:
            raise InputError("--last-logits is for decoder-only LMs; an encoder-decoder's decoder keeps every "
                             "position's logits: export without it")
        last_logits = False
    context = _passes.PassContext(opset, attention, functions, axes, required=dynamic_axes is not None or with_past,
                                  quantize=options.quantize, last_logits=last_logits,
                                  max_positions=_max_positions(model, attention))
    outcomes = _finish_graph(proto, context, sample.notes)
    result = _result(path, proto, inputs, sample, context, outcomes, dtype, cached)
    _write_metadata(proto, result, _came_out_dynamic(axes, context.labels))
    _save(proto, path, _check_ort_model if attention == "ort" else None)
    if cached is not None and cached.contract.encoder_decoder:  # its encoder, a file beside it
        encoder_options = dataclasses.replace(options, with_past=False)
        result.encoder = _seq2seq.export_encoder(model, example_inputs, path, encoder_options, cached.contract)
    return result


def _max_positions(model, attention: str) -> Optional[int]:
    """The model's position limit from its transformers config, for the ort flavor's rotary
    caches; None for another flavor or a model that is not a transformers one (transformers is
    not imported then: a transformers model cannot exist without it, and it is optional)."""
    if attention != "ort" or "transformers" not in sys.modules:
        return None
    from attn_export.surgery.transformers.models import max_positions

    return max_positions(model)


def _finish_graph(proto, context: _passes.PassContext, notes: list) -> list:
    """The graph passes (onnx/passes: axis labels, runtime-safe rewrites, the flavor, a cached
    export's cache form, the node's functions, every value's shape), in order; their notes join
    the export's. Returns their outcomes."""
    outcomes = _passes.run_passes(proto, context)
    notes.extend(note for outcome in outcomes for note in outcome.notes)
    return outcomes


def _result(path: Path, proto, inputs, sample: SampleRun, context: _passes.PassContext, outcomes: list,
            dtype: Optional[str], cached) -> ExportResult:
    """What the export reports, once the graph is finished."""
    rewrite = context.standard
    return ExportResult(
        path=path, opset=context.opset, dtype=dtype or _dtype_name(inputs),
        input_names=[n for n in inputs if context.position_ids or n != POSITION_IDS],
        output_names=sample.output_names, dynamic_axes=context.labels,
        num_attention_nodes=count_attention_nodes(proto), replacement=sample.report, notes=sample.notes,
        attention=context.attention, functions=context.functions,
        num_standard_attention_nodes=rewrite.converted if rewrite else 0, kept_custom=rewrite.kept if rewrite else [],
        with_past=dataclasses.replace(cached.contract, last_logits=context.last_logits is True,
                                      position_ids=cached.contract.position_ids and context.position_ids).to_dict()
        if cached is not None else None, passes=outcomes,
    )


def _contract_names(proto, cached, inputs, axes):
    """The cached export's graph inputs, inputs and axes under the contract's names, and one
    symbol per axis label (attn_export.onnx.with_past)."""
    names = cached.contract_names
    _with_past.rename_inputs(proto, names)
    axes = {names.get(n, n): d for n, d in axes.items()}
    _with_past.unify_symbols(proto, axes)
    return {names.get(n, n): t for n, t in inputs.items()}, axes


def _working_copy(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], dtype: Optional[str],
                  dynamic_axes: Optional[Mapping[str, Mapping[int, str]]], with_past: bool = False, seed: int = 0):
    """What is exported: a copy of ``model`` in eval mode and in ``dtype`` (a transformers model
    without its key/value cache among the outputs), its inputs in ``forward``'s order and in that
    dtype, the axes to export dynamic, and None; with ``with_past``, the copy wrapped with its
    cache as flat inputs, their example, the contract's axes, and the CachedExport."""
    if with_past:
        _with_past.check_request(model, dynamic_axes)
    work, inputs, axes = _plain_copy(model, example_inputs, dtype, dynamic_axes)
    if not with_past:
        return work, inputs, axes, None
    cached = _with_past.prepare(work, inputs, seed)
    return cached.module, cached.inputs, cached.axes, cached


def _plain_copy(model: nn.Module, example_inputs: Mapping[str, torch.Tensor], dtype: Optional[str],
                dynamic_axes: Optional[Mapping[str, Mapping[int, str]]]):
    work = copy.deepcopy(model).eval()
    is_hf = _hf.contains_hf_model(work)
    if is_hf:
        _hf.prepare_for_export(work)
    target = EXPORT_DTYPES.get(dtype) if dtype else None
    if target is not None:
        work = work.to(target)
    inputs = _inputs.cast_floats(_inputs.order_for_model(work, example_inputs), target)
    if target is None and any(t.dtype == torch.float64 for t in inputs.values()):
        raise InputError("float64 inputs: the fused node supports float32/float16/bfloat16; export with --dtype fp32")
    return work, inputs, _resolve_axes(inputs, dynamic_axes, is_hf)


def _came_out_dynamic(axes, labels) -> Dict[str, Dict[int, str]]:
    """The declared axes that came out dynamic: the metadata's, the gate's."""
    axes = {n: {a: lbl for a, lbl in d.items() if a in labels.get(n, {})} for n, d in axes.items()}
    return {n: d for n, d in axes.items() if d}


def _check_options(opset: Optional[int], dtype: Optional[str], attention: str, functions: str) -> int:
    """The opset to export with, after the flavor, function mode, opset and dtype are checked."""
    check_choices(attention, functions)
    opset = export_opset(opset, attention)
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise InputError(f"--dtype {dtype}: one of {', '.join(EXPORT_DTYPES)}")
    return opset


def _resolve_axes(inputs, dynamic_axes, is_hf: bool) -> Dict[str, Dict[int, str]]:
    if dynamic_axes is None:
        axes = _hf.default_axes(inputs) if is_hf else _inputs.default_axes(inputs)
    else:
        axes = {n: dict(d) for n, d in dynamic_axes.items() if d}
    for name in axes:
        if name not in inputs:
            raise InputError(f"dynamic axes name an unknown input {name!r} (inputs: {', '.join(inputs)})")
    return axes


def _write_metadata(proto, result: ExportResult, dynamic_axes: Dict[str, Dict[int, str]]) -> None:
    """The export's facts as ``attn_export.*`` metadata (read_metadata), and the producer."""
    meta = {
        "version": _package_version(),
        "dtype": result.dtype,
        "dynamic_axes": json.dumps({n: {str(a): lbl for a, lbl in d.items()} for n, d in dynamic_axes.items()}),
        "input_names": json.dumps(result.input_names),
        "output_names": json.dumps(result.output_names),
        "attention_nodes": str(result.num_attention_nodes),
        "attention": result.attention,
        "functions": result.functions,
    }
    props = {META_PREFIX + key: value for key, value in meta.items()}
    if result.with_past is not None:  # a cached export: its cache's contract
        props.update(CacheContract(**result.with_past).to_metadata())
    for key, value in props.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    proto.producer_name = "attn-export"
    proto.producer_version = _package_version()


def _dtype_name(inputs: Mapping[str, torch.Tensor]) -> str:
    for t in inputs.values():
        if t.dtype.is_floating_point:
            return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}[t.dtype]
    return "fp32"


def _package_version() -> str:
    from attn_export._version import __version__

    return __version__


# Names this module imported before the passes had modules of their own.
__getattr__ = moved_names(__name__, {
    "apply_axis_labels": "attn_export.onnx.passes.label_axes",
    "attach_function": "attn_export.onnx.passes.attach_functions",
    "fold_past": "attn_export.onnx.passes.fold_past_custom",
    "inline_functions": "attn_export.onnx.passes.inline_functions",
    "output_names_for": "attn_export.onnx.outputs",
    "project_before_transposing_inputs": "attn_export.onnx.passes.project_before_transpose",
    "record_shapes": "attn_export.onnx.passes.record_shapes",
    "to_standard_attention": "attn_export.onnx.passes.standard_attention",
    "translation_table": "attn_export.onnx.translation",
})
