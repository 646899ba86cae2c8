"""Checks of the exported graph (and engine) that need no run: every axis declared dynamic is
symbolic, the attention nodes carry their function, a cached export has its contract's inputs,
outputs and layouts, the engine belongs to the file."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional

from attn_export import spec as _spec
from attn_export.cache_contract import TOKEN_INPUTS
from attn_export.validation.report import CaseResult, CheckResult
from attn_export.validation.runners import BACKEND_TRT


def dynamic_axes_check(declared: Mapping[str, Mapping[int, str]], symbolic: Mapping[str, Mapping[int, str]]) -> CheckResult:
    baked = [f"{n}:{a} ({lbl})" for n, d in declared.items() for a, lbl in d.items() if a not in symbolic.get(n, {})]
    return CheckResult(
        "dynamic axes", not baked,
        "declared dynamic but static in the ONNX graph: " + ", ".join(baked) if baked else
        "symbolic: " + (", ".join(f"{n}:{a}={lbl}" for n, d in symbolic.items() for a, lbl in d.items()) or "(none declared)"),
    )


def attention_checks(onnx_model, metadata: Dict[str, str]) -> List[CheckResult]:
    """The FusedAttention nodes have their model-local function (the portable body), and as
    many as the exporter recorded."""
    from attn_export.onnx import count_attention_nodes
    from attn_export.onnx.node import is_attention_domain

    s = _spec.load()
    nodes = count_attention_nodes(onnx_model)
    checks = []
    if nodes:
        called = {n.domain for n in onnx_model.graph.node if n.op_type == s.op_type and is_attention_domain(n.domain)}
        has_function = called <= {f.domain for f in onnx_model.functions if f.name == s.op_type}
        checks.append(CheckResult(
            "attention function", has_function,
            f"{nodes} {s.domain}.{s.op_type} node(s), model-local function "
            + ("attached" if has_function else "MISSING: runtimes without the plugin cannot run the node"),
        ))
    expected = metadata.get("attention_nodes")
    if expected is not None and int(expected) != nodes:
        checks.append(CheckResult("attention nodes", False, f"metadata says {expected} nodes, graph has {nodes}"))
    return checks


def _dims(value) -> list:
    """A graph value's dims: a dim_param (str), a fixed size (int) or None (unknown)."""
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in value.type.tensor_type.shape.dim]


def _cache_problem(name: str, dims: list, contract) -> Optional[str]:
    if len(dims) != 4:
        return f"{name} has rank {len(dims)}, not 4 [batch, num_kv_heads, past_sequence, head_dim]"
    if dims[1] not in (contract.num_kv_heads, None) or dims[3] not in (contract.head_dim, None):
        return f"{name} is {dims}: the metadata says {contract.num_kv_heads} key/value heads of head_dim " \
               f"{contract.head_dim}"
    if isinstance(dims[2], int):
        return f"{name}'s sequence axis is fixed at {dims[2]}: the cache must grow (a symbolic axis)"
    return None


def cache_contract_check(onnx_model, contract) -> CheckResult:
    """A cached export's graph has its contract's (attn_export/cache_contract.py) inputs and
    outputs, the cache tensors the contract's heads and head dim, and one batch symbol on every
    batch axis: what a generation runtime looks up by name, checked before anything runs."""
    inputs = {v.name: _dims(v) for v in onnx_model.graph.input}
    outputs = {v.name: _dims(v) for v in onnx_model.graph.output}
    problems = [f"no input {n}" for n in contract.input_names() if n not in inputs]
    problems += [f"no output {n}" for n in contract.output_names() if n not in outputs]
    problems += [f"input {n} present but the metadata says the model takes none" for n in TOKEN_INPUTS
                 if n in inputs and n not in contract.token_inputs()]
    cache = {n: d for n, d in {**inputs, **outputs}.items() if contract.is_past(n) or contract.is_present(n)}
    problems += [p for n, d in cache.items() if (p := _cache_problem(n, d, contract))]
    batch_symbols = sorted({str(d[0]) for d in list(inputs.values()) + list(outputs.values()) if d})
    if len(batch_symbols) > 1:
        problems.append(f"the batch axes carry {len(batch_symbols)} symbols ({', '.join(batch_symbols)}), not one")
    return CheckResult(
        "cache layout", not problems,
        "; ".join(problems) if problems else
        f"{contract.num_layers} layer(s) of past/present [batch, {contract.num_kv_heads}, past_sequence, "
        f"{contract.head_dim}], {contract.dtype}, "
        + ("takes position_ids" if contract.position_ids else "no position_ids"))


def engine_check(engine, graph_inputs: List[str], output_names: List[str], nodes: int) -> CheckResult:
    """The engine belongs to this ONNX file (same inputs and outputs) and ran every attention
    node as a plugin layer (as recorded beside it by build_engine)."""
    if sorted(engine.inputs) != sorted(graph_inputs) or sorted(engine.outputs) != sorted(output_names):
        return CheckResult(
            "tensorrt engine", False,
            f"the engine's inputs {engine.inputs} / outputs {engine.outputs} are not the ONNX graph's "
            f"{graph_inputs} / {output_names}: was it built from another model?",
        )
    meta = engine.metadata
    if not meta:
        return CheckResult("tensorrt engine", True, "no build record beside the engine: plugin layer count unknown")
    layers = meta.get("plugin_layers")
    ok = layers == nodes
    return CheckResult(
        "tensorrt engine", ok,
        f"{layers} FusedAttention plugin layer(s) for {nodes} node(s)"
        + ("" if ok else ": the engine does not run every node as the plugin"),
    )


def tensorrt_coverage_check(cases: List[CaseResult]) -> CheckResult:
    ran = [c for c in cases if c.backend == BACKEND_TRT and c.status != "skipped"]
    return CheckResult(
        "tensorrt coverage", bool(ran),
        f"{len({c.case for c in ran})} case(s) ran in TensorRT" if ran else
        "no case ran in TensorRT (see the skipped cases: shapes outside the engine's optimization profile "
        "need an engine built with wider --min-shapes/--max-shapes)",
    )
