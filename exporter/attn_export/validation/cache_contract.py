"""The cached export's names and layouts, checked on the graph before anything runs: the inputs
and outputs a generation runtime looks up by name (Optimum's), the cache's shapes as the
metadata records them, and every batch axis one symbol (docs/validation.md, "Generation")."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from attn_export.validation.report import CheckResult

Dims = List[object]  # a dim_param (str), a fixed size (int) or None (unknown)


def contract_names(num_layers: int, position_ids: bool) -> Tuple[List[str], List[str]]:
    """(inputs, outputs) of a cached export, in order."""
    past = [f"past_key_values.{i}.{k}" for i in range(num_layers) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(num_layers) for k in ("key", "value")]
    return ["input_ids", "attention_mask"] + (["position_ids"] if position_ids else []) + past, ["logits"] + present


def _dims(value) -> Dims:
    return [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in value.type.tensor_type.shape.dim]


def _cache_problems(name: str, dims: Dims, heads: int, head_dim: int) -> Optional[str]:
    if len(dims) != 4:
        return f"{name} has rank {len(dims)}, not 4 [batch, num_kv_heads, past_sequence, head_dim]"
    if dims[1] not in (heads, None) or dims[3] not in (head_dim, None):
        return f"{name} is {dims}: the metadata says {heads} key/value heads of head_dim {head_dim}"
    if isinstance(dims[2], int):
        return f"{name}'s sequence axis is fixed at {dims[2]}: the cache must grow (a symbolic axis)"
    return None


def cache_contract_check(onnx_model, layout) -> CheckResult:
    """The graph has the contract's inputs and outputs, the cache tensors the metadata's heads
    and head dim, and one batch symbol on every batch axis."""
    inputs = {v.name: _dims(v) for v in onnx_model.graph.input}
    outputs = {v.name: _dims(v) for v in onnx_model.graph.output}
    want_in, want_out = contract_names(layout.num_layers, layout.position_ids)
    problems = [f"no input {n}" for n in want_in if n not in inputs]
    problems += [f"no output {n}" for n in want_out if n not in outputs]
    if "position_ids" in inputs and not layout.position_ids:
        problems.append("input position_ids present but the metadata says the model takes none")
    cache = {n: d for n, d in {**inputs, **outputs}.items() if n.startswith(("past_key_values.", "present."))}
    problems += [p for n, d in cache.items() if (p := _cache_problems(n, d, layout.num_kv_heads, layout.head_dim))]
    batch_symbols = sorted({str(d[0]) for d in list(inputs.values()) + list(outputs.values()) if d})
    if len(batch_symbols) > 1:
        problems.append(f"the batch axes carry {len(batch_symbols)} symbols ({', '.join(batch_symbols)}), not one")
    return CheckResult(
        "cache layout", not problems,
        "; ".join(problems) if problems else
        f"{layout.num_layers} layer(s) of past_key_values/present [batch, {layout.num_kv_heads}, past_sequence, "
        f"{layout.head_dim}], {layout.dtype}, " + ("takes position_ids" if layout.position_ids else "no position_ids"))


def declared_axes(layout) -> Dict[str, Dict[int, str]]:
    """The axes of the contract that must be symbolic."""
    names, _ = contract_names(layout.num_layers, layout.position_ids)
    return {n: ({0: "batch", 2: "past_sequence"} if n.startswith("past_key_values.") else
                {0: "batch", 1: "total_sequence" if n == "attention_mask" else "sequence"}) for n in names}
