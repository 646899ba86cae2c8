"""Helpers on the exported graph: output names, symbolic-axis labels, the attention nodes and
their model-local function, the exporter's metadata."""
from __future__ import annotations

import re
from typing import Dict, List, Mapping

import onnx
import torch

from attn_export.onnx import node as onnx_node
from attn_export import spec as _spec

META_PREFIX = "attn_export."


def output_names_for(outputs, taken=()) -> List[str]:
    """Names of the flattened outputs: ``output`` for one tensor, ``output_0``... for a tuple,
    the keys for a dict (nested containers joined with ``_``); a name in ``taken`` (the input
    names: an ONNX graph names every value once) gets ``_output`` appended."""
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
    taken = set(taken)
    unique = []
    for name in names:
        while name in taken:
            name = f"{name}_output"
        taken.add(name)
        unique.append(name)
    return unique


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
    return len(attention_nodes(model))


def attention_nodes(model: onnx.ModelProto) -> List[onnx.NodeProto]:
    s = _spec.load()
    return [n for n in model.graph.node if n.op_type == s.op_type and onnx_node.is_attention_domain(n.domain)]


def value_types(model: onnx.ModelProto) -> Dict[str, int]:
    """Element type of every graph value whose type the graph records (inputs, initializers,
    value_info, outputs)."""
    types = {i.name: i.data_type for i in model.graph.initializer}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if value.type.HasField("tensor_type"):
            types[value.name] = value.type.tensor_type.elem_type
    return types


def value_dims(model: onnx.ModelProto) -> Dict[str, List[object]]:
    """Shape of every graph value whose shape the graph records: per axis a size (int), a
    symbol (str; equal symbols are equal sizes) or None (unknown)."""
    dims = {i.name: list(i.dims) for i in model.graph.initializer}
    for value in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            dims[value.name] = [d.dim_param if d.HasField("dim_param") else (d.dim_value if d.HasField("dim_value") else None)
                                for d in value.type.tensor_type.shape.dim]
    return dims


def attach_function(model: onnx.ModelProto, opset: int) -> None:
    """Gives each FusedAttention node of the spec's domain the lean body of its variant (static
    attributes and query type; onnx_node.BodyVariant): the node moves to the variant's domain,
    and the model carries one function per variant used and imports each variant's domain.
    Nodes already in a variant's domain, and functions the model already carries, are left as
    they are.

    The model's first function named FusedAttention is the generic body (of the nodes' form:
    the cache form's when they have it), in the spec's domain, called by no node: TensorRT's ONNX parser keys model-local functions by name alone (the first
    one wins), and when it runs a node's function rather than the plugin (parsers before 10.15
    prefer the function; later ones fall back to it without the plugin) it must get a body that
    is right for every node, whatever its variant (docs/onnx_node.md)."""
    s = _spec.load()
    types = value_types(model)
    have = {f.domain for f in model.functions if f.name == s.op_type}
    for node in attention_nodes(model):
        if node.domain != s.domain:
            continue
        variant = onnx_node.BodyVariant.of_node(node, types.get(node.input[0]))
        node.domain = variant.domain
        if variant.domain not in have:
            model.functions.append(onnx_node.lean_function_proto(opset, variant))
            have.add(variant.domain)
    _generic_body_first(model, opset)
    used = {n.domain for n in model.graph.node} | {f.domain for f in model.functions}
    imported = {o.domain for o in model.opset_import}
    model.opset_import.extend(onnx.helper.make_opsetid(d, s.domain_version) for d in sorted(used - imported)
                              if onnx_node.is_attention_domain(d))
    # Model-local functions are ONNX IR version 8.
    model.ir_version = max(model.ir_version, 8)


def _generic_body_first(model: onnx.ModelProto, opset: int) -> None:
    """The generic body as the model's first function named FusedAttention (attach_function)."""
    s = _spec.load()
    named = [f for f in model.functions if f.name == s.op_type]
    if named and named[0].domain == s.domain:
        return
    # The cache form's nodes (custom_past.fold_past folds all of a model's nodes or none) need
    # the generic body of their signature: 7 inputs, 3 outputs.
    past = any(len(n.input) > len(s.input_names) for n in attention_nodes(model))
    generic = [f for f in named if f.domain == s.domain] or [onnx_node.function_proto(opset, past=past)]
    rest = [f for f in model.functions if f not in generic]
    del model.functions[:]
    model.functions.extend(generic + rest)


def inline_functions(model: onnx.ModelProto) -> None:
    """Writes the FusedAttention nodes' bodies into the graph (``onnx.inliner``) and drops the
    functions and the domains they leave unused: a function-free model of standard ops."""
    import onnx.inliner

    model.CopyFrom(onnx.inliner.inline_local_functions(model))
    used = {n.domain for n in model.graph.node} | {n.domain for f in model.functions for n in f.node}
    imports = [o for o in model.opset_import if not onnx_node.is_attention_domain(o.domain) or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(imports)


def record_shapes(model: onnx.ModelProto) -> None:
    """Runs ONNX shape inference (through the model-local functions, with data propagation) and
    keeps what it finds in ``value_info``: every intermediate value gets its type and, where it
    can be known, its shape, so tools that read shapes from the file (Polygraphy, quantizers,
    TensorRT's parser) see them; torch's exporter leaves some values (the attention outputs, the
    out-projections) with a type alone. Not strict: a value inference cannot type stays as the
    exporter wrote it. Models over protobuf's 2 GB limit are left alone (saving refuses them)."""
    if model.ByteSize() > 2**31 - 1:
        return
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=False, data_prop=True)
    model.CopyFrom(inferred)


def read_metadata(model: onnx.ModelProto) -> Dict[str, str]:
    return {p.key[len(META_PREFIX):]: p.value for p in model.metadata_props if p.key.startswith(META_PREFIX)}


def project_before_transposing_inputs(model: onnx.ModelProto) -> int:
    """Rewrites ``graph input -> Transpose(perm) -> MatMul(., W)`` (W a 2-D float16 initializer,
    ``perm`` keeping the last axis in place) as ``MatMul(input, W) -> Transpose(perm)``: the same
    math, since MatMul with a 2-D right operand acts on the last axis alone. ONNX Runtime 1.32
    (CPU) segfaults at its default optimization level on the first form (docs/onnx_node.md,
    "ONNX Runtime: Transpose -> MatMul on a graph input"); user models write it whenever they
    transpose a sequence-first input before an fp16 nn.Linear. Returns how many MatMuls moved."""
    inputs = {v.name for v in model.graph.input}
    weights = {i.name: i for i in model.graph.initializer}
    transposes = {}
    for node in model.graph.node:
        if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and node.input[0] in inputs:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if perm and perm[-1] == len(perm) - 1:
                transposes[node.output[0]] = (node, perm)
    moved = 0
    nodes = []
    for node in model.graph.node:
        found = transposes.get(node.input[0]) if node.op_type == "MatMul" and node.input else None
        weight = weights.get(node.input[1]) if found else None
        if weight is None or len(weight.dims) != 2 or weight.data_type != onnx.TensorProto.FLOAT16:
            nodes.append(node)
            continue
        transpose, perm = found
        projected = f"{node.output[0]}__before_transpose"
        nodes.append(onnx.helper.make_node("MatMul", [transpose.input[0], node.input[1]], [projected],
                                           name=f"{node.name}__projected" if node.name else ""))
        nodes.append(onnx.helper.make_node("Transpose", [projected], list(node.output), perm=perm,
                                           name=f"{node.name}__transposed" if node.name else ""))
        moved += 1
    if moved:
        used = {name for n in nodes for name in n.input} | {o.name for o in model.graph.output}
        kept = [n for n in nodes if not (n.op_type == "Transpose" and n.output[0] in transposes
                                         and n.output[0] not in used)]
        dropped = {n.output[0] for n in nodes if n not in kept}
        del model.graph.node[:]
        model.graph.node.extend(kept)
        info = [v for v in model.graph.value_info if v.name not in dropped]
        del model.graph.value_info[:]
        model.graph.value_info.extend(info)
    return moved
