"""ONNX export with one portable custom node per fused attention layer.

    >>> result = attn_export.export_onnx(model, {"src": x}, "model.onnx")
    >>> result.num_attention_nodes, result.dynamic_axes

Path: ``torch.export`` keeps ``attn_export::multi_head_attention`` (and ``attention``) as single
nodes; torch's ONNX exporter translates each through ``custom_translation_table`` into ordinary
MatMul/Add projections on the initializers, ONE ``attn_export.FusedAttention`` node (the
attention core, docs/onnx_node.md) and the output projection. After export the node's
model-local function (standard ONNX ops) is attached, the symbolic dimensions are renamed to
the requested labels and ``onnx.checker.check_model(full_check=True)`` runs; the file is
written whole or not at all.

Why the projections sit outside the node: runtimes fuse and tune plain MatMul/Gemm on
initializers well (and can quantize them), and the TensorRT plugin then implements only the
attention core, the same kernels as the PyTorch operator.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import numpy as np
import onnx
import torch
from torch import nn

from attn_export import hf as _hf
from attn_export import inputs as _inputs
from attn_export import onnx_node
from attn_export import spec as _spec
from attn_export._errors import ExportError, InputError, first_line as _first_line
from attn_export._io import atomic_output

DEFAULT_OPSET = 20
EXPORT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
META_PREFIX = "attn_export."


# --------------------------------------------------------------------------------------------
# Translation of the operators (run by torch's exporter, in onnxscript's tracing mode)
# --------------------------------------------------------------------------------------------

def _ops():
    import onnxscript

    return onnxscript.opset18, onnxscript.values.Opset(_spec.load().domain, _spec.load().domain_version)


def _const(op, values, dtype=np.int64):
    import onnx_ir as ir

    return op.Constant(value=ir.tensor(np.asarray(values, dtype=dtype)))


def _is_bool(value) -> bool:
    import onnx_ir as ir

    return value.dtype == ir.DataType.BOOL


def _additive_mask(op, mask):
    """bool (true = masked out) -> float32 -inf/0; floating -> float32."""
    import onnx_ir as ir

    if _is_bool(mask):
        return op.Where(mask, _const(op, -np.inf, np.float32), _const(op, 0.0, np.float32))
    if mask.dtype == ir.DataType.FLOAT:
        return mask
    return op.Cast(mask, to=ir.DataType.FLOAT)


def _static_dim(value, axis: int, what: str) -> int:
    dim = value.shape[axis] if value.shape is not None else None
    if not isinstance(dim, int):
        raise ExportError(f"{what} must be static for export; got {dim}")
    return dim


def _mask_inputs(op, key_padding_mask, attn_mask, num_heads: int):
    """The node's two mask inputs (rank 2 and rank 4, float32 additive) and their has_* flags."""
    if key_padding_mask is None:
        kpm = _const(op, np.zeros((1, 1), np.float32), np.float32)
    else:
        kpm = _additive_mask(op, key_padding_mask)
        if len(key_padding_mask.shape) == 1:  # unbatched [Lk]
            kpm = op.Unsqueeze(kpm, _const(op, [0]))
    if attn_mask is None:
        mask = _const(op, np.zeros((1, 1, 1, 1), np.float32), np.float32)
    else:
        mask = _additive_mask(op, attn_mask)
        rank = len(attn_mask.shape)
        if rank == 2:  # [Lq, Lk]
            mask = op.Unsqueeze(mask, _const(op, [0, 1]))
        elif rank == 3:  # [B*H, Lq, Lk] (or [1, Lq, Lk])
            if attn_mask.shape[0] == 1:
                mask = op.Unsqueeze(mask, _const(op, [0]))
            else:
                tail = op.Shape(mask, start=1)
                mask = op.Reshape(mask, op.Concat(_const(op, [-1, num_heads]), tail, axis=0))
        elif rank != 4:
            raise ExportError(f"attn_mask of rank {rank} is not supported")
    return kpm, mask, key_padding_mask is not None, attn_mask is not None


def _fused_node(custom, q, k, v, kpm, mask, *, num_heads, scale, is_causal, has_kpm, has_mask):
    attrs = onnx_node.node_attributes(num_heads, scale, is_causal, has_kpm, has_mask)
    return getattr(custom, _spec.load().op_type)(q, k, v, kpm, mask, **attrs)


def _probabilities(op, q, k, kpm, mask, *, num_heads, scale, is_causal):
    """Attention probabilities [B, H, Lq, Lk] in standard ops (only for need_weights=True;
    removed again by the exporter's optimizer when the model does not use them)."""
    import onnx_ir as ir

    split = op.Concat(_const(op, [0, 0]), _const(op, [num_heads]), _const(op, [-1]), axis=0)
    qh = op.Transpose(op.Reshape(op.Cast(q, to=ir.DataType.FLOAT), split), perm=[0, 2, 1, 3])
    kh = op.Transpose(op.Reshape(op.Cast(k, to=ir.DataType.FLOAT), split), perm=[0, 2, 3, 1])
    s = op.Mul(op.MatMul(qh, kh), _const(op, scale, np.float32))
    s = op.Add(op.Add(s, op.Unsqueeze(kpm, _const(op, [1, 2]))), mask)
    if is_causal:
        lq = op.Shape(q, start=1, end=2)
        lk = op.Shape(k, start=1, end=2)
        ones = op.Expand(_const(op, 1.0, np.float32), op.Concat(lq, lk, axis=0))
        visible = op.Cast(op.Trilu(ones, upper=0), to=ir.DataType.BOOL)
        s = op.Where(visible, s, _const(op, -np.inf, np.float32))
    dead = op.IsInf(op.ReduceMax(s, _const(op, [-1]), keepdims=1), detect_positive=0)
    return op.Where(dead, _const(op, 0.0, np.float32), op.Softmax(s, axis=-1))


def _linear(op, x, weight, bias, rows: Optional[slice] = None):
    if rows is not None:
        start, stop = rows.start, rows.stop
        weight = op.Slice(weight, _const(op, [start]), _const(op, [stop]), _const(op, [0]))
        if bias is not None:
            bias = op.Slice(bias, _const(op, [start]), _const(op, [stop]), _const(op, [0]))
    y = op.MatMul(x, op.Transpose(weight, perm=[1, 0]))
    return y if bias is None else op.Add(y, bias)


def translate_multi_head_attention(
    query, key, value, num_heads: int, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
    attn_mask=None, key_padding_mask=None, need_weights: bool = True, average_attn_weights: bool = True,
    is_causal: bool = False, batch_first: bool = False,
):
    """``attn_export::multi_head_attention`` -> projections + one FusedAttention + output projection."""
    op, custom = _ops()
    rank = len(query.shape)
    unbatched = rank == 2
    same_qkv = query is key and key is value
    shared_kv = not same_qkv and key is value

    def to_batch_first(x):
        if unbatched:
            return op.Unsqueeze(x, _const(op, [0]))
        return x if batch_first else op.Transpose(x, perm=[1, 0, 2])

    embed_dim = _static_dim(in_proj_weight, 1, "embed_dim (in_proj_weight.shape[1])")
    scale = 1.0 / math.sqrt(embed_dim // num_heads)
    xq = to_batch_first(query)
    if same_qkv:
        q, k, v = op.Split(_linear(op, xq, in_proj_weight, in_proj_bias), axis=-1, num_outputs=3)
    else:
        q = _linear(op, xq, in_proj_weight, in_proj_bias, slice(0, embed_dim))
        xk = to_batch_first(key)
        if shared_kv:
            k, v = op.Split(
                _linear(op, xk, in_proj_weight, in_proj_bias, slice(embed_dim, 3 * embed_dim)),
                axis=-1, num_outputs=2,
            )
        else:
            k = _linear(op, xk, in_proj_weight, in_proj_bias, slice(embed_dim, 2 * embed_dim))
            v = _linear(op, to_batch_first(value), in_proj_weight, in_proj_bias, slice(2 * embed_dim, 3 * embed_dim))
    kpm, mask, has_kpm, has_mask = _mask_inputs(op, key_padding_mask, attn_mask, num_heads)
    attn = _fused_node(custom, q, k, v, kpm, mask, num_heads=num_heads, scale=scale, is_causal=is_causal,
                       has_kpm=has_kpm, has_mask=has_mask)
    out = _linear(op, attn, out_proj_weight, out_proj_bias)
    if unbatched:
        out = op.Squeeze(out, _const(op, [0]))
    elif not batch_first:
        out = op.Transpose(out, perm=[1, 0, 2])

    if need_weights:
        probs = _probabilities(op, q, k, kpm, mask, num_heads=num_heads, scale=scale, is_causal=is_causal)
        if average_attn_weights:
            probs = op.ReduceMean(probs, _const(op, [1]), keepdims=0)
        if unbatched:
            probs = op.Squeeze(probs, _const(op, [0]))
        weights = op.CastLike(probs, query)
    else:
        weights = op.CastLike(_const(op, np.zeros((0,), np.float32), np.float32), query)
    return out, weights


def translate_attention(query, key, value, attn_mask=None, key_padding_mask=None, is_causal: bool = False,
                        scale: float = None):
    """``attn_export::attention`` (q, k, v ``[B, H, L, D]``) -> one FusedAttention node
    between a head merge and a head split."""
    op, custom = _ops()
    heads = _static_dim(query, 1, "the number of heads (query.shape[1])")
    head_dim = _static_dim(query, 3, "the head dimension (query.shape[3])")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    merge = _const(op, [0, 0, -1])

    def pack(x):  # [B, H, L, D] -> [B, L, H*D]
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), merge)

    if attn_mask is not None and len(attn_mask.shape) == 4:
        kpm, _, has_kpm, _ = _mask_inputs(op, key_padding_mask, None, heads)
        mask, has_mask = _additive_mask(op, attn_mask), True
    else:
        kpm, mask, has_kpm, has_mask = _mask_inputs(op, key_padding_mask, attn_mask, heads)
    out = _fused_node(custom, pack(query), pack(key), pack(value), kpm, mask, num_heads=heads, scale=scale,
                      is_causal=is_causal, has_kpm=has_kpm, has_mask=has_mask)
    split = _const(op, [0, 0, heads, -1])
    return op.Transpose(op.Reshape(out, split), perm=[0, 2, 1, 3])


def translation_table() -> dict:
    onnx_node.register_schema()
    ops = torch.ops.attn_export
    return {
        ops.multi_head_attention.default: translate_multi_head_attention,
        ops.attention.default: translate_attention,
    }


# --------------------------------------------------------------------------------------------
# export_onnx
# --------------------------------------------------------------------------------------------

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
        }


def output_names_for(outputs) -> List[str]:
    """Names of the flattened outputs: ``output`` for one tensor, ``output_0``... for a tuple,
    the keys for a dict (nested containers joined with ``_``)."""
    from torch.utils import _pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path(_plain(outputs))
    if len(leaves) == 1 and not leaves[0][0]:
        return ["output"]
    names = []
    for path, _ in leaves:
        parts = []
        for key in path:
            for attr in ("key", "idx", "name"):
                if hasattr(key, attr):
                    parts.append(str(getattr(key, attr)))
                    break
        name = "_".join(parts)
        names.append(name if re.match(r"^[A-Za-z_]", name) else f"output_{name}")
    return names


def flatten_outputs(outputs) -> List[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(_plain(outputs))]


def _plain(outputs):
    """Mappings of other types (transformers' ModelOutput, which older transformers registers
    with torch's pytree without key paths) as plain dicts, in their own order."""
    if isinstance(outputs, Mapping) and type(outputs) is not dict:
        return {k: _plain(v) for k, v in outputs.items()}
    if isinstance(outputs, dict):
        return {k: _plain(v) for k, v in outputs.items()}
    if type(outputs) in (list, tuple):
        return type(outputs)(_plain(v) for v in outputs)
    return outputs


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


def _dynamic_shapes(inputs: Mapping[str, torch.Tensor], axes: Mapping[str, Mapping[int, str]]):
    """torch.export dynamic_shapes: Dim.AUTO per declared axis (the model decides which axes
    are tied), except labels the user put on several axes, which share one named Dim."""
    from torch.export import Dim

    counts: Dict[str, int] = {}
    for dims in axes.values():
        for label in dims.values():
            counts[label] = counts.get(label, 0) + 1
    default_labels = set()
    for name, dims in _inputs.default_axes(inputs).items():
        default_labels.update(dims.values())
    named: Dict[str, object] = {}
    shapes = {}
    for name in inputs:
        dims = axes.get(name)
        if not dims:
            shapes[name] = None
            continue
        spec = {}
        for axis, label in dims.items():
            if counts[label] > 1 and label not in default_labels:
                named.setdefault(label, Dim(label))
                spec[axis] = named[label]
            else:
                spec[axis] = Dim.AUTO
        shapes[name] = spec
    return shapes


def _graph_dims(model: onnx.ModelProto, name: str) -> List[object]:
    for value in model.graph.input:
        if value.name == name:
            return [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
                    for d in value.type.tensor_type.shape.dim]
    raise KeyError(name)


def _normalize_numeric_dims(model: onnx.ModelProto) -> None:
    """torch's exporter can write a specialized size as dim_param "5"; make it dim_value 5."""
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and re.fullmatch(r"\d+", dim.dim_param.strip()):
                dim.dim_value = int(dim.dim_param)


def _rename_symbols(model: onnx.ModelProto, mapping: Mapping[str, str]) -> None:
    if not mapping:
        return
    pattern = re.compile(r"\b(" + "|".join(re.escape(k) for k in sorted(mapping, key=len, reverse=True)) + r")\b")
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for value in values:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_param = pattern.sub(lambda m: mapping[m.group(1)], dim.dim_param)


def apply_axis_labels(model: onnx.ModelProto, axes: Mapping[str, Mapping[int, str]]) -> tuple[dict, list]:
    """Renames the graph's symbolic dims to the requested labels. Returns the labels per input
    as they came out and the declared axes that came out static."""
    _normalize_numeric_dims(model)
    mapping: Dict[str, str] = {}
    taken: Dict[str, str] = {}
    static = []
    for name, dims in axes.items():
        graph_dims = _graph_dims(model, name)
        for axis, label in dims.items():
            symbol = graph_dims[axis]
            if not isinstance(symbol, str) or not symbol:
                static.append((name, axis, label, symbol))
                continue
            if symbol in mapping:
                continue
            final = label if label not in taken else f"{label}_{name}"
            mapping[symbol] = final
            taken[final] = symbol
    # Symbols that are not labels yet must not collide with a label.
    _rename_symbols(model, mapping)
    result = {}
    for name in axes:
        graph_dims = _graph_dims(model, name)
        result[name] = {axis: graph_dims[axis] for axis in axes[name] if isinstance(graph_dims[axis], str)}
    return result, static


def count_attention_nodes(model: onnx.ModelProto) -> int:
    s = _spec.load()
    return sum(1 for n in model.graph.node if n.op_type == s.op_type and n.domain == s.domain)


def attach_function(model: onnx.ModelProto, opset: int) -> None:
    s = _spec.load()
    for f in model.functions:
        if f.domain == s.domain and f.name == s.op_type:
            return
    model.functions.append(onnx_node.function_proto(opset))
    if not any(o.domain == s.domain for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(s.domain, s.domain_version))


def default_opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


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
) -> ExportResult:
    """Exports ``model`` to ONNX at ``path`` with one ``attn_export.FusedAttention`` node per
    fused attention layer.

    Args:
        model: the model; not modified (a copy is replaced and exported, in eval mode). A
            transformers model is exported without its key/value cache (``use_cache=False``).
        example_inputs: name -> tensor, the names of ``model.forward``'s parameters; they become
            the ONNX graph's input names.
        path: the .onnx file to write (atomically).
        opset: default-domain ONNX opset (>= 18; default 20).
        dtype: "fp32" (default: the model's own), "fp16" or "bf16": exports in that precision.
        dynamic_axes: input -> {axis: label}; default: dim 0 "batch" and dim 1 a sequence label
            for every input (see attn_export.inputs.default_axes; for transformers models
            attn_export.hf.default_axes: batch and sequence of the token inputs, the batch of
            the others); ``{}`` exports static shapes.
        replace: run :func:`attn_export.replace_attention` on the copy first.
        quiet: silence torch's exporter output.
    """
    from attn_export.replace import replace_attention

    s = _spec.load()
    opset = DEFAULT_OPSET if opset is None else int(opset)
    if opset < s.min_onnx_opset or opset > onnx.defs.onnx_opset_version():
        raise InputError(f"--opset {opset}: supported are {s.min_onnx_opset}..{onnx.defs.onnx_opset_version()}")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise InputError(f"--dtype {dtype}: one of {', '.join(EXPORT_DTYPES)}")
    path = Path(path)
    _check_writable(path)

    work = copy.deepcopy(model).eval()
    is_hf = _hf.contains_hf_model(work)
    if is_hf:
        _hf.prepare_for_export(work)  # no key/value cache among the outputs
    report = replace_attention(work) if replace else None
    target = EXPORT_DTYPES.get(dtype) if dtype else None
    if target is not None:
        work = work.to(target)
    inputs = _inputs.cast_floats(_inputs.order_for_model(work, example_inputs), target)
    if target is None and any(t.dtype == torch.float64 for t in inputs.values()):
        raise InputError("float64 inputs: the fused node supports float32/float16/bfloat16; export with --dtype fp32")
    if dynamic_axes is None:
        axes = _hf.default_axes(inputs) if is_hf else _inputs.default_axes(inputs)
    else:
        axes = {n: dict(d) for n, d in dynamic_axes.items() if d}
    for name in axes:
        if name not in inputs:
            raise InputError(f"dynamic axes name an unknown input {name!r} (inputs: {', '.join(inputs)})")

    with torch.no_grad():
        try:
            outputs = work(**inputs)
        except Exception as exc:  # noqa: BLE001 - the model rejected the inputs
            raise InputError(f"the model rejected the example inputs {_inputs.describe(inputs)}: {_first_line(exc)}") from exc
    output_names = output_names_for(outputs)
    trace_inputs, notes = _check_trace_sizes(inputs, axes, seed)

    # torch.export first, by hand: given a module, torch.onnx.export falls back to
    # torch.export.draft_export when export proper fails, which ignores shape guards and can
    # label an axis dynamic that the model specializes. An ExportedProgram is taken as it is.
    with _quiet_exporter(quiet):
        try:
            exported = torch.export.export(
                work, (), kwargs=trace_inputs, strict=False,
                dynamic_shapes=_dynamic_shapes(trace_inputs, axes) if axes else None,
            )
        except Exception as exc:  # noqa: BLE001 - surfaced as one line (traceback with --verbose)
            raise ExportError(f"torch.export could not capture the model: {_first_line(exc)}") from exc
        try:
            program = torch.onnx.export(
                exported, (), dynamo=True, opset_version=opset,
                custom_translation_table=translation_table(), output_names=output_names,
                optimize=True, verbose=False, external_data=False,
            )
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"torch.onnx.export failed: {_first_line(exc)}") from exc
    proto = program.model_proto

    labels, static = apply_axis_labels(proto, axes)
    if static:
        listed = ", ".join(f"{n}:{a} ({lbl}, came out as {v})" for n, a, lbl, v in static)
        raise ExportError(
            f"axes declared dynamic came out static: {listed}. The model specializes them (a shape-dependent "
            "branch or a constant size inside); give --dynamic to declare the right axes or --static"
        )
    if count_attention_nodes(proto):
        attach_function(proto, opset)
    meta = {
        "version": _package_version(),
        "dtype": dtype or _dtype_name(inputs),
        "dynamic_axes": json.dumps({n: {str(a): lbl for a, lbl in d.items()} for n, d in axes.items()}),
        "input_names": json.dumps(list(inputs)),
        "output_names": json.dumps(output_names),
        "attention_nodes": str(count_attention_nodes(proto)),
    }
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = META_PREFIX + key, value
    proto.producer_name = "attn-export"
    proto.producer_version = _package_version()
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"the exported model fails onnx.checker.check_model(full_check=True): {_first_line(exc)}") from exc
    if proto.ByteSize() > 2**31 - 1:
        raise ExportError("the model is larger than 2 GB; external-data export is not supported yet")
    try:
        with atomic_output(path) as tmp:
            onnx.save_model(proto, str(tmp))
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    return ExportResult(
        path=path, opset=opset, dtype=meta["dtype"], input_names=list(inputs), output_names=output_names,
        dynamic_axes=labels, num_attention_nodes=count_attention_nodes(proto), replacement=report, notes=notes,
    )


def read_metadata(model: onnx.ModelProto) -> Dict[str, str]:
    return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}


def _check_writable(path: Path) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise InputError(f"cannot write {path}: directory {directory} does not exist")
    if path.is_dir():
        raise InputError(f"cannot write {path}: it is a directory")
    import os

    if not os.access(directory, os.W_OK):
        raise InputError(f"cannot write {path}: directory {directory} is not writable")


def _dtype_name(inputs: Mapping[str, torch.Tensor]) -> str:
    for t in inputs.values():
        if t.dtype.is_floating_point:
            return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}[t.dtype]
    return "fp32"


def _package_version() -> str:
    from attn_export import __version__

    return __version__
