"""``export_onnx``: replace, trace with torch.export (dynamic batch and sequence), translate
with torch's ONNX exporter, attach the node's function, label the axes, check, write."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Set

import onnx
import torch
from torch import nn

from attn_export.surgery import transformers as _hf
from attn_export import inputs as _inputs
from attn_export.errors import ExportError, InputError, first_line as _first_line
from attn_export.atomic_io import atomic_output
from attn_export.onnx import dims as _dims
from attn_export.onnx import with_past as _with_past
from attn_export.onnx import ort as _ort
from attn_export.onnx.custom_past import fold_past
from attn_export.onnx.graph import (
    META_PREFIX,
    apply_axis_labels,
    attach_function,
    count_attention_nodes,
    inline_functions,
    output_names_for,
    project_before_transposing_inputs,
    record_shapes,
)
from attn_export.surgery.patterns import rewrite as rewrite_patterns
from attn_export.onnx.standard import to_standard_attention
from attn_export.onnx.translation import translation_table
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


@dataclass
class ExportResult:
    path: Path
    opset: int
    dtype: str
    input_names: List[str]
    output_names: List[str]
    dynamic_axes: Dict[str, Dict[int, str]]  # input -> {axis: label in the ONNX graph}
    num_attention_nodes: int
    replacement: Optional[object] = None  # ReplacementReport when export_onnx replaced layers
    notes: List[str] = field(default_factory=list)
    attention: str = "custom"  # the flavor asked for
    functions: str = "local"  # or "inline": no model-local function, no custom node
    num_standard_attention_nodes: int = 0
    kept_custom: List[str] = field(default_factory=list)  # standard flavor: layers left custom, and why
    with_past: Optional[dict] = None  # a cached export: the cache's geometry (the metadata's attn_export.with_past)

    def to_dict(self) -> dict:
        return {
            "path": str(self.path),
            "opset": self.opset,
            "dtype": self.dtype,
            "input_names": self.input_names,
            "output_names": self.output_names,
            "dynamic_axes": {n: {str(a): lbl for a, lbl in d.items()} for n, d in self.dynamic_axes.items()},
            "num_attention_nodes": self.num_attention_nodes,
            "replacement": self.replacement.to_dict() if self.replacement is not None else None,
            "notes": self.notes,
            "attention": self.attention,
            "functions": self.functions,
            "num_standard_attention_nodes": self.num_standard_attention_nodes,
            "kept_custom": self.kept_custom,
            "with_past": self.with_past,
        }


@contextlib.contextmanager
def _quiet_exporter(enabled: bool):
    """torch's exporter prints progress and warnings; keep the tool's output clean."""
    if not enabled:
        yield
        return
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnxscript", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _check_trace_sizes(inputs, axes, seed):
    """Example sizes below 2 on a dynamic axis would be specialized by torch.export (0/1
    specialization); trace at size 2 instead."""
    sizes = _inputs.label_sizes(inputs, axes)
    small = {label: 2 for label, size in sizes.items() if size < 2}
    if not small:
        return inputs, []
    note = (
        "traced at size 2 for " + ", ".join(sorted(small)) +
        " (an example size of 1 would be baked into the graph as a constant)"
    )
    return _inputs.resize(inputs, axes, {**sizes, **small}, seed=seed), [note]


def _translations(model: nn.Module) -> dict:
    """torch.onnx's custom translations: the attn_export operators', over transformers' own for
    the ops its models emit (transformers models only)."""
    table = _hf.models.onnx_translations() if _hf.contains_hf_model(model) else {}
    table.update(translation_table())
    return table


def export_onnx(
    model: nn.Module,
    example_inputs: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    opset: Optional[int] = None,
    dtype: Optional[str] = None,
    dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None,
    replace: bool = True,
    quiet: bool = True,
    seed: int = 0,
    attention: str = DEFAULT_ATTENTION,
    functions: str = DEFAULT_FUNCTIONS,
    with_past: bool = False,
) -> ExportResult:
    """Exports ``model`` to ONNX at ``path`` with one ``attn_export.FusedAttention`` node per
    fused attention layer.

    Args:
        model: the model; not modified (a copy is replaced and exported, in eval mode). A
            transformers model is exported without its key/value cache (``use_cache=False``).
        example_inputs: name -> tensor, the names of ``model.forward``'s parameters; they become
            the ONNX graph's input names.
        path: the .onnx file to write (atomically).
        opset: default-domain ONNX opset (>= 18; default 20, 23 with ``attention="standard"``).
        dtype: "fp32" (default: the model's own), "fp16" or "bf16": exports in that precision.
        dynamic_axes: input -> {axis: label}, each of which must come out dynamic; ``{}`` exports
            static shapes. Default: dim 0 "batch" and dim 1 a sequence label for every input of
            rank 2 or 3, the batch of 4-D images (see attn_export.inputs.default_axes; for transformers
            models attn_export.surgery.transformers.default_axes), where a default axis the model
            specializes stays static with a note. The inputs' batch axes come out as one symbol
            ``batch`` where the example's sizes agree, and so does a label given to several axes
            (attn_export.onnx.dims).
        replace: run :func:`attn_export.replace_attention` on the copy first.
        quiet: silence torch's exporter output.
        attention: "custom" (default): one FusedAttention node per layer, with its model-local
            function; "standard": one standard ``Attention`` node (opset >= 23) per layer where
            it can express the layer, the custom node where not (``kept_custom`` says why).
        functions: "local" (default): each custom node calls its model-local function;
            "inline": the bodies are written into the graph instead, no custom node is left
            (for runtimes that do not read model-local functions; the TensorRT plugin then has
            nothing to map).
        with_past: a transformers decoder-only causal LM with its key/value cache: one graph for
            prefill and decode, Optimum's names (attn_export.onnx.with_past, docs/huggingface.md);
            ``example_inputs``: ``input_ids`` [, ``attention_mask``]; ``dynamic_axes`` None.
    """
    opset = _check_options(opset, dtype, attention, functions)
    path = Path(path)
    _check_writable(path)
    work, inputs, axes, cached = _working_copy(model, example_inputs, dtype, dynamic_axes, with_past, seed)
    sample = _sample_run(work, inputs, axes, replace, seed)
    proto = _capture(work, sample, axes, opset, quiet)
    if cached is not None:
        inputs, axes = _contract_names(proto, cached, inputs, axes)
    labels, rewrite = _finish_graph(proto, axes, opset, attention, functions, sample.notes,
                                    required=dynamic_axes is not None or with_past)
    result = ExportResult(
        path=path, opset=opset, dtype=dtype or _dtype_name(inputs), input_names=list(inputs),
        output_names=sample.output_names, dynamic_axes=labels, num_attention_nodes=count_attention_nodes(proto),
        replacement=sample.report, notes=sample.notes, attention=attention, functions=functions,
        num_standard_attention_nodes=rewrite.converted if rewrite else 0, kept_custom=rewrite.kept if rewrite else [],
        with_past=cached.geometry.to_dict() if cached is not None else None,
    )
    _write_metadata(proto, result, _came_out_dynamic(axes, labels))
    _save(proto, path, _ort.check_model if attention == "ort" else onnx.checker.check_model)
    return result


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


@dataclass
class _SampleRun:
    report: Optional[object]  # the ReplacementReport; None without replacement
    output_names: List[str]
    trace_inputs: Dict[str, torch.Tensor]  # the inputs, resized where torch.export would specialize
    notes: List[str]
    shared: Set[str]  # the axis labels traced as one named Dim (onnx/dims.py)


def _sample_run(work: nn.Module, inputs, axes, replace: bool, seed: int) -> _SampleRun:
    """Replaces the attention of ``work`` (optionally), runs it on the inputs and names its
    outputs. The replacement's plan is a sample forward with the export's inputs (it finds where
    SDPA calls run), and the run after it, on the routed model, says which calls were fused."""
    from attn_export.surgery.replace import replace_attention

    report = replace_attention(work, inputs) if replace else None
    with torch.no_grad():
        try:
            outputs = work(**inputs)
        except Exception as exc:  # noqa: BLE001 - the model rejected the inputs
            raise InputError(f"the model rejected the example inputs {_inputs.describe(inputs)}: {_first_line(exc)}") from exc
    output_names = output_names_for(outputs, taken=inputs)
    confirmed = report.confirm_sdpa_calls(work) if report is not None else []
    # Decided on the example as given: resizing an axis of size 1 to 2 can make sizes agree.
    shared, notes = _dims.shared_labels(inputs, axes)
    trace_inputs, resized = _check_trace_sizes(inputs, axes, seed)
    notes.extend(resized)
    notes.extend(f"not fused: {line}" for line in confirmed)
    return _SampleRun(report, output_names, trace_inputs, notes, shared)


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


def _capture(work, sample: _SampleRun, axes, opset: int, quiet: bool):
    """torch.export, the pattern rewrite, then torch.onnx.export: the ModelProto."""
    with _quiet_exporter(quiet):
        exported = _trace(work, sample, axes)
        if sample.report is not None:
            # Hand-written softmax(q k^T) v in the captured graph -> the operator (exact matches only).
            sample.report.add_pattern_sites(rewrite_patterns(exported), work)
        try:
            program = torch.onnx.export(
                exported, (), dynamo=True, opset_version=opset,
                custom_translation_table=_translations(work), output_names=sample.output_names,
                optimize=True, verbose=False, external_data=False,
            )
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"torch.onnx.export failed: {_first_line(exc)}") from exc
    return program.model_proto


def _trace(work, sample: _SampleRun, axes):
    """torch.export with the shared Dims (onnx/dims.py). Where torch.export refuses the one
    batch Dim, or ties it to an axis declared otherwise, the model is traced again with a batch
    symbol per input (a note says why)."""
    shared = sample.shared
    if _dims.BATCH in shared:
        try:
            exported = _export(work, sample.trace_inputs, axes, shared)
            absorbed = _dims.absorbed(exported, axes, {_dims.BATCH})
            if not absorbed:
                return exported
            why = f"the trace tied it to {', '.join(absorbed)}"
        except Exception as exc:  # noqa: BLE001 - traced again below
            why = f"torch.export refused it: {_first_line(exc)}"
        sample.notes.append(f"the inputs' batch axes are separate symbols, not one {_dims.BATCH!r} ({why})")
        shared = shared - {_dims.BATCH}
    try:
        return _export(work, sample.trace_inputs, axes, shared)
    except Exception as exc:  # noqa: BLE001 - surfaced as one line (traceback with --verbose)
        raise ExportError(f"torch.export could not capture the model: {_first_line(exc)}{_hint(exc)}") from exc


def _export(work, trace_inputs, axes, shared: Set[str]):
    # torch.export first, by hand: given a module, torch.onnx.export falls back to
    # torch.export.draft_export when export proper fails, which ignores shape guards and can
    # label an axis dynamic that the model specializes. An ExportedProgram is taken as it is.
    return torch.export.export(work, (), kwargs=trace_inputs, strict=False,
                               dynamic_shapes=_dims.dynamic_shapes(trace_inputs, axes, shared) if axes else None)


def _hint(exc: BaseException) -> str:
    """What to try for the capture failures whose fix is known."""
    if "SymBool" in str(exc):
        return (" (a bool computed from a dynamic size, such as is_causal=q.shape[2] > 1: keep that input's "
                "sequence static, e.g. --dynamic NAME:0=batch for it, or --static)")
    return ""


def _finish_graph(proto, axes, opset: int, attention: str, functions: str, notes: List[str], required: bool):
    """Axis labels (an axis declared dynamic, ``required``, that came out static is an error; a
    default one is dropped with a note), the runtime-safe rewrites, the standard flavor, the
    function bodies (a cached export's custom nodes in their cache form), every value's shape. Returns
    (labels, the standard rewrite)."""
    labels, static = apply_axis_labels(proto, axes)
    if static:
        listed = ", ".join(f"{n}:{a} ({lbl}, came out as {v})" for n, a, lbl, v in static)
        if required:
            raise ExportError(
                f"axes declared dynamic came out static: {listed}. The model specializes them (a shape-dependent "
                "branch or a constant size inside); give --dynamic to declare the right axes or --static"
            )
        notes.append(f"default dynamic axes the model specializes stay static: {listed} (--dynamic declares others)")
    if project_before_transposing_inputs(proto):
        notes.append("an fp16 projection of a transposed graph input now runs before the transpose (the other "
                     "order crashes ONNX Runtime 1.32 at its default optimization level; docs/onnx_node.md)")
    rewrite = to_standard_attention(proto) if attention == "standard" else None
    if rewrite is not None:
        notes.extend(f"kept as the custom node: {line}" for line in rewrite.kept)
    if count_attention_nodes(proto):
        fold_past(proto)  # a cached export: the Concat(past, new) into the nodes' cache form
        if attention == "ort":  # ONNX Runtime's contrib operators where they compute the node (onnx/ort/)
            rewrite = _ort.finish(proto, notes)
    if count_attention_nodes(proto):
        attach_function(proto, opset)
        if functions == "inline":
            inline_functions(proto)
    record_shapes(proto)
    return labels, rewrite


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
    if result.with_past is not None:
        meta[_with_past.META_KEY] = json.dumps(result.with_past, sort_keys=True)
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = META_PREFIX + key, value
    proto.producer_name = "attn-export"
    proto.producer_version = _package_version()


def _save(proto, path: Path, check=onnx.checker.check_model) -> None:
    """Checked (full_check) and written whole or not at all."""
    try:
        check(proto, full_check=True)
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"the exported model fails onnx.checker.check_model(full_check=True): {_first_line(exc)}") from exc
    if proto.ByteSize() > 2**31 - 1:
        raise ExportError("the model is larger than 2 GB; external-data export is not supported yet")
    try:
        with atomic_output(path) as tmp:
            onnx.save_model(proto, str(tmp))
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _check_writable(path: Path) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise InputError(f"cannot write {path}: directory {directory} does not exist")
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a directory")

    if not os.access(directory, os.W_OK):
        raise InputError(f"cannot write {path}: directory {directory} is not writable")


def _dtype_name(inputs: Mapping[str, torch.Tensor]) -> str:
    for t in inputs.values():
        if t.dtype.is_floating_point:
            return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}[t.dtype]
    return "fp32"


def _package_version() -> str:
    from attn_export._version import __version__

    return __version__
