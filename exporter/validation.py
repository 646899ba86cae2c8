"""The parity gate: the original PyTorch model against the replaced PyTorch model, ONNX
Runtime and (given an engine) TensorRT, at several shapes, with tolerances derived from the
dtype (docs/validation.md).

    >>> report = attn_export.validate(model, "model.onnx", {"src": x})
    >>> report = attn_export.validate(model, "model.onnx", {"src": x}, engine="model.engine")
    >>> report.passed, report.to_json(), report.to_junit_xml()

Cases: the example shape, batch 1, sequence 1, an odd sequence length and a longer one (per
symbolic axis of the ONNX graph; axes the graph ties together keep one size). Inputs at new
shapes come from :func:`attn_export.inputs.resize`. Graph checks: every axis declared dynamic is
symbolic in the ONNX graph, the attention nodes and their function are there.
"""
from __future__ import annotations

import copy
import json
import math
import platform
import re
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

import numpy as np
import torch
from torch import nn

from attn_export import hf as _hf
from attn_export import inputs as _inputs
from attn_export._errors import InputError, first_line as _first_line

# rtol = TOLERANCE_FACTOR * eps(dtype) * sqrt(K); see docs/validation.md.
TOLERANCE_FACTOR = 8.0
BACKEND_REPLACED = "pytorch-replaced"
BACKEND_ORT = "onnxruntime"
BACKEND_TRT = "tensorrt"
_DTYPE_FROM_NAME = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
_ONNX_ELEM_TO_TORCH = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16, 11: torch.float64, 7: torch.int64,
                       6: torch.int32, 9: torch.bool, 2: torch.uint8, 3: torch.int8, 5: torch.int16}


@dataclass
class CaseResult:
    case: str
    backend: str
    output: str
    shapes: Dict[str, List[int]]
    status: str  # passed | failed | error | skipped
    passed: bool
    max_abs_err: Optional[float] = None
    max_rel_err: Optional[float] = None
    atol: Optional[float] = None
    rtol: Optional[float] = None
    nan_mismatch: int = 0
    baseline_err: Optional[float] = None  # same-dtype PyTorch original vs fp32 reference (fp16/bf16)
    message: str = ""
    seconds: float = 0.0


@dataclass
class CheckResult:
    name: str
    passed: bool
    message: str


@dataclass
class ValidationReport:
    cases: List[CaseResult]
    checks: List[CheckResult]
    dtype: str
    tolerance: Dict[str, object]
    environment: Dict[str, object]
    onnx_path: str
    input_names: List[str]
    output_names: List[str]
    notes: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        ran = [c for c in self.cases if c.status != "skipped"]
        return bool(ran) and all(c.passed for c in ran) and all(c.passed for c in self.checks)

    @property
    def failures(self) -> List[str]:
        out = [f"check {c.name}: {c.message}" for c in self.checks if not c.passed]
        for c in self.cases:
            if c.status in ("failed", "error"):
                out.append(f"{c.case} / {c.backend} / {c.output}: {c.message}")
        if not any(c.status != "skipped" for c in self.cases):
            out.append("no case ran")
        return out

    def to_dict(self) -> Dict:
        return _finite_json({
            "passed": self.passed,
            "onnx": self.onnx_path,
            "dtype": self.dtype,
            "inputs": self.input_names,
            "outputs": self.output_names,
            "tolerance": self.tolerance,
            "checks": [asdict(c) for c in self.checks],
            "cases": [asdict(c) for c in self.cases],
            "failures": self.failures,
            "notes": self.notes,
            "environment": self.environment,
        })

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False, default=_json_default) + "\n"

    def to_junit_xml(self) -> str:
        suite = ET.Element("testsuite", name="attn-export validate")
        props = ET.SubElement(suite, "properties")
        for key, value in self.environment.items():
            ET.SubElement(props, "property", name=str(key), value=str(value))
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        for check in self.checks:
            counts["tests"] += 1
            tc = ET.SubElement(suite, "testcase", classname="attn_export.validate.checks", name=check.name, time="0")
            if not check.passed:
                counts["failures"] += 1
                ET.SubElement(tc, "failure", message=check.message).text = check.message
        for case in self.cases:
            counts["tests"] += 1
            tc = ET.SubElement(
                suite, "testcase", classname=f"attn_export.validate.{case.backend}",
                name=f"{case.case}/{case.output}", time=f"{case.seconds:.3f}",
            )
            detail = (
                f"shapes={json.dumps(case.shapes)} max_abs_err={case.max_abs_err} max_rel_err={case.max_rel_err} "
                f"atol={case.atol} rtol={case.rtol} nan_mismatch={case.nan_mismatch}"
            )
            if case.status == "failed":
                counts["failures"] += 1
                ET.SubElement(tc, "failure", message=case.message).text = detail
            elif case.status == "error":
                counts["errors"] += 1
                ET.SubElement(tc, "error", message=case.message).text = detail
            elif case.status == "skipped":
                counts["skipped"] += 1
                ET.SubElement(tc, "skipped", message=case.message)
            else:
                ET.SubElement(tc, "system-out").text = detail
        for key, value in counts.items():
            suite.set(key, str(value))
        root = ET.Element("testsuites")
        root.append(suite)
        ET.indent(root)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"

    def table(self):
        from rich.table import Table

        verdict = "[green]PASSED[/]" if self.passed else "[red]FAILED[/]"
        table = Table(title=f"Parity vs the original PyTorch model ({self.dtype}): {verdict}")
        for col in ("case", "input shapes", "backend", "output", "max abs err", "max rel err", "rtol", "result"):
            table.add_column(col, justify="right" if col.startswith(("max", "rtol")) else "left")
        style = {"passed": "green", "failed": "red", "error": "red", "skipped": "yellow"}
        for c in self.cases:
            shapes = " ".join(f"{n}={'x'.join(map(str, s))}" for n, s in c.shapes.items())
            result = f"[{style[c.status]}]{c.status.upper()}[/]"
            if c.status != "passed" and c.message:
                result += f" {c.message}"
            table.add_row(c.case, shapes, c.backend, c.output, _fmt(c.max_abs_err), _fmt(c.max_rel_err),
                          _fmt(c.rtol), result)
        return table

    def lines(self) -> List[str]:
        """Polygraphy-style one line per check and per case."""
        out = []
        for c in self.checks:
            out.append(f"{'PASSED' if c.passed else 'FAILED'} | check {c.name} | {c.message}")
        for c in self.cases:
            out.append(
                f"{c.status.upper()} | {c.case} | {c.backend} | {c.output} | max_abs_err={_fmt(c.max_abs_err)} "
                f"max_rel_err={_fmt(c.max_rel_err)} rtol={_fmt(c.rtol)} atol={_fmt(c.atol)}"
                + (f" | {c.message}" if c.message else "")
            )
        return out


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.2e}" if math.isfinite(x) else str(x))


def _finite_json(obj):
    """JSON has no inf/NaN: such floats become the strings "inf", "-inf", "nan"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def _json_default(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return str(obj)


# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------

def reduction_length(model: nn.Module, inputs: Mapping[str, torch.Tensor], axes: Mapping[str, Mapping[int, str]]) -> int:
    """K: the longest reduction the model does: the largest feature width it contracts over
    (Linear in_features, attention embed_dim, normalized size) or the longest sequence (the
    attention's sum over keys)."""
    widths = [1]
    for m in model.modules():
        if isinstance(m, nn.Linear):
            widths.append(m.in_features)
        elif type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
            widths.append(int(m.weight.shape[0]))  # transformers' Conv1D (GPT-2): weight [in, out]
        elif hasattr(m, "embed_dim") and isinstance(getattr(m, "embed_dim"), int):
            widths.append(m.embed_dim)
        elif isinstance(m, nn.LayerNorm):
            widths.append(int(np.prod(m.normalized_shape)))
    for name, dims in axes.items():
        for axis, label in dims.items():
            if not _inputs.label_is_batch(label) and name in inputs:
                widths.append(int(inputs[name].shape[axis]))
    return max(widths)


def tolerance(dtype: torch.dtype, k: int) -> float:
    """rtol = TOLERANCE_FACTOR * eps(dtype) * sqrt(K), relative to the output's largest magnitude."""
    return TOLERANCE_FACTOR * torch.finfo(dtype).eps * math.sqrt(max(k, 1))


def compare(actual: torch.Tensor, expected: torch.Tensor, rtol: float,
            valid: Optional[torch.Tensor] = None) -> Dict[str, object]:
    """Errors of ``actual`` against ``expected``; floats judged by max|a - e| <= rtol * max|e|
    over the positions where the reference is finite, plus: a NaN/inf where the reference is
    finite fails. Non-float outputs must match exactly. ``valid`` (booleans of the outputs'
    shape) restricts every check to those positions (e.g. the valid tokens of a padded batch)."""
    if tuple(actual.shape) != tuple(expected.shape):
        return {"passed": False, "message": f"shape {list(actual.shape)} != reference {list(expected.shape)}",
                "max_abs_err": None, "max_rel_err": None, "atol": None, "nan_mismatch": 0}
    if valid is not None:
        actual, expected = actual[valid], expected[valid]
    if not expected.dtype.is_floating_point:
        diff = int((actual.to(expected.dtype) != expected).sum())
        return {"passed": diff == 0, "message": "" if diff == 0 else f"{diff} element(s) differ",
                "max_abs_err": float(diff), "max_rel_err": float(diff), "atol": 0.0, "nan_mismatch": 0}
    a, e = actual.detach().double(), expected.detach().double()
    ref_finite = torch.isfinite(e)
    nan_mismatch = int((ref_finite & ~torch.isfinite(a)).sum())
    # Where the reference is +-inf the backend must give the same infinity; where it is NaN
    # anything goes (e.g. nn.MultiheadAttention's NaN rows, which the fused op makes zeros).
    inf_mismatch = int((torch.isinf(e) & (a != e)).sum())
    both = ref_finite & torch.isfinite(a)
    scale = float(e[ref_finite].abs().max()) if ref_finite.any() else 0.0
    max_abs = float((a - e)[both].abs().max()) if both.any() else 0.0
    atol = rtol * max(scale, torch.finfo(torch.float32).tiny)
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    problems = []
    if nan_mismatch:
        problems.append(f"{nan_mismatch} NaN/inf where the reference is finite")
    if inf_mismatch:
        problems.append(f"{inf_mismatch} infinities differ")
    if max_abs > atol:
        problems.append(f"max abs err {max_abs:.3e} > atol {atol:.3e}")
    return {"passed": not problems, "message": "; ".join(problems), "max_abs_err": max_abs,
            "max_rel_err": max_rel, "atol": atol, "nan_mismatch": nan_mismatch + inf_mismatch}


# --------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------

def graph_axes(onnx_model, names: List[str]) -> Dict[str, Dict[int, str]]:
    """input -> {axis: dim_param} for the symbolic axes of the ONNX graph's inputs."""
    axes: Dict[str, Dict[int, str]] = {}
    for value in onnx_model.graph.input:
        if value.name not in names:
            continue
        dims = {}
        for i, d in enumerate(value.type.tensor_type.shape.dim):
            if d.HasField("dim_param") and d.dim_param and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", d.dim_param):
                dims[i] = d.dim_param
        if dims:
            axes[value.name] = dims
    return axes


def _label_kinds(axes: Mapping[str, Mapping[int, str]]) -> Dict[str, str]:
    kinds: Dict[str, str] = {}
    for dims in axes.values():
        for axis, label in dims.items():
            if label in kinds:
                continue
            low = label.lower()
            if "batch" in low:
                kinds[label] = "batch"
            elif "seq" in low or "len" in low:
                kinds[label] = "seq"
            else:
                kinds[label] = "batch" if axis == 0 else "seq"
    return kinds


def shape_cases(example_sizes: Mapping[str, int], kinds: Mapping[str, str]) -> List[tuple]:
    """[(name, {label: size})]: example, batch=1, seq=1, seq=odd, seq=long (sequence labels
    get distinct sizes so independent lengths are exercised as independent)."""
    batch = [lbl for lbl in example_sizes if kinds.get(lbl) == "batch"]
    seq = [lbl for lbl in example_sizes if kinds.get(lbl) == "seq"]
    cases = [("example", {})]
    if batch:
        cases.append(("batch=1", {lbl: 1 for lbl in batch}))
    if seq:
        longest = max(example_sizes[lbl] for lbl in seq)
        odd = 9 if any(example_sizes[lbl] == 7 for lbl in seq) else 7
        cases.append(("seq=1", {lbl: 1 for lbl in seq}))
        cases.append(("seq=odd", {lbl: odd + 2 * i for i, lbl in enumerate(seq)}))
        long = max(2 * longest, 48)
        cases.append(("seq=long", {lbl: long + 2 * i for i, lbl in enumerate(seq)}))
    return cases


# --------------------------------------------------------------------------------------------
# validate
# --------------------------------------------------------------------------------------------

def environment(seed: int) -> Dict[str, object]:
    import onnx
    import onnxruntime

    from attn_export import __version__

    try:
        import onnxscript

        onnxscript_version = onnxscript.__version__
    except Exception:  # noqa: BLE001
        onnxscript_version = None
    return {
        "attn_export": __version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "onnxscript": onnxscript_version,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "onnxruntime_providers": ["CPUExecutionProvider"],
        "seed": seed,
    }


def _run_torch(model: nn.Module, inputs: Mapping[str, torch.Tensor]):
    from attn_export.onnx_export import flatten_outputs

    with torch.no_grad():
        return flatten_outputs(model(**inputs))


def _prepared(model: nn.Module) -> nn.Module:
    """An eval-mode copy; transformers models without their key/value cache in the outputs
    (as exported)."""
    copied = copy.deepcopy(model).eval()
    if _hf.contains_hf_model(copied):
        _hf.prepare_for_export(copied)
    return copied


def _positions(valid_tokens: Optional[torch.Tensor], output: torch.Tensor) -> Optional[torch.Tensor]:
    """The [B, L] valid-token mask broadcast over an output of shape [B, L, ...]; None (every
    position compared) for outputs of other shapes."""
    if valid_tokens is None or output.dim() < 2 or tuple(output.shape[:2]) != tuple(valid_tokens.shape):
        return None
    return valid_tokens.reshape(*valid_tokens.shape, *([1] * (output.dim() - 2))).expand(output.shape)


class _ReferenceMode:
    """The reference runs the original model with PyTorch's native MHA fast paths off: the
    nested-tensor path of nn.TransformerEncoder writes zeros at padded positions, which no
    exported graph reproduces (nor needs to). Restored afterwards."""

    def __enter__(self):
        self._was = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)

    def __exit__(self, *exc):
        torch.backends.mha.set_fastpath_enabled(self._was)


def validate(
    model: nn.Module,
    onnx_path: str | Path,
    example_inputs: Mapping[str, torch.Tensor],
    *,
    dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None,
    seed: int = 0,
    progress: Optional[Callable[[str], None]] = None,
    engine: Optional[str | Path] = None,
    plugin: Optional[str | Path] = None,
) -> ValidationReport:
    """Runs the original model (float32 reference), the replaced model, ONNX Runtime and, with
    ``engine``, a TensorRT engine built from ``onnx_path``, at the example shape, batch 1,
    sequence 1, an odd and a longer sequence, and compares every output.

    Args:
        model: the ORIGINAL model (not modified; copies are made).
        onnx_path: the exported file.
        example_inputs: name -> tensor, as for export.
        dynamic_axes: the axes that must be symbolic in the graph; default: what the exporter
            recorded in the file's metadata, else dim 0 and 1 of every input.
        seed: for the generated inputs.
        progress: called with a short description before each step.
        engine: a TensorRT engine of ``onnx_path`` (attn_export.tensorrt.build_engine); needs
            TensorRT and a GPU (TensorRTUnavailable otherwise). Shapes outside its optimization
            profile are reported as skipped; at least one case must run.
        plugin: the FusedAttention plugin library for the engine (default: as
            attn_export.tensorrt.find_plugin_library looks for it).
    """
    import onnx
    import onnxruntime as ort

    from attn_export.onnx_export import count_attention_nodes, output_names_for, read_metadata
    from attn_export.replace import replace_attention
    from attn_export import spec as _spec

    say = progress or (lambda _msg: None)
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise InputError(f"{onnx_path}: no such file")
    try:
        onnx_model = onnx.load(str(onnx_path))
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{onnx_path}: not a readable ONNX file ({_first_line(exc)})") from exc
    meta = read_metadata(onnx_model)
    graph_inputs = [v.name for v in onnx_model.graph.input]
    init_names = {i.name for i in onnx_model.graph.initializer}
    graph_inputs = [n for n in graph_inputs if n not in init_names]
    dtype_name = meta.get("dtype") or _dtype_of_graph(onnx_model)
    dtype = _DTYPE_FROM_NAME.get(dtype_name, torch.float32)

    is_hf = _hf.contains_hf_model(model)
    reference = _prepared(model).float()
    inputs = _inputs.order_for_model(reference, example_inputs)
    missing = [n for n in graph_inputs if n not in inputs]
    if missing:
        raise InputError(f"the ONNX graph needs input(s) {', '.join(missing)} that were not given (inputs: {', '.join(inputs)})")
    ref_inputs = _inputs.cast_floats(inputs, torch.float32)

    say("running the original model at the example shape")
    try:
        with _ReferenceMode():
            example_out = reference(**ref_inputs)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"the model rejected the example inputs {_inputs.describe(inputs)}: {_first_line(exc)}") from exc
    output_names = json.loads(meta["output_names"]) if "output_names" in meta else output_names_for(example_out)

    # Graph checks.
    checks: List[CheckResult] = []
    if dynamic_axes is None:
        if "dynamic_axes" in meta:
            declared = {n: {int(a): lbl for a, lbl in d.items()} for n, d in json.loads(meta["dynamic_axes"]).items()}
        else:
            declared = _inputs.default_axes({n: inputs[n] for n in graph_inputs})
    else:
        declared = {n: dict(d) for n, d in dynamic_axes.items() if d}
    symbolic = graph_axes(onnx_model, graph_inputs)
    baked = [f"{n}:{a} ({lbl})" for n, d in declared.items() for a, lbl in d.items() if a not in symbolic.get(n, {})]
    checks.append(CheckResult(
        "dynamic axes", not baked,
        "declared dynamic but static in the ONNX graph: " + ", ".join(baked) if baked else
        "symbolic: " + (", ".join(f"{n}:{a}={lbl}" for n, d in symbolic.items() for a, lbl in d.items()) or "(none declared)"),
    ))
    s = _spec.load()
    nodes = count_attention_nodes(onnx_model)
    has_function = any(f.domain == s.domain and f.name == s.op_type for f in onnx_model.functions)
    if nodes:
        checks.append(CheckResult(
            "attention function", has_function,
            f"{nodes} {s.domain}.{s.op_type} node(s), model-local function "
            + ("attached" if has_function else "MISSING: runtimes without the plugin cannot run the node"),
        ))
    expected_nodes = meta.get("attention_nodes")
    if expected_nodes is not None and int(expected_nodes) != nodes:
        checks.append(CheckResult("attention nodes", False, f"metadata says {expected_nodes} nodes, graph has {nodes}"))

    # Backends.
    replaced = _prepared(model)
    replacement = replace_attention(replaced)
    replaced = replaced.to(dtype) if dtype != torch.float32 else replaced.float()
    baseline_model = None
    if dtype in (torch.float16, torch.bfloat16):
        baseline_model = _prepared(model).to(dtype)
    say("loading the ONNX model in ONNX Runtime")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = None
    session_error = None
    try:
        session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        session_error = f"ONNX Runtime cannot load the model: {_first_line(exc)}"

    runner = None
    if engine is not None:
        from attn_export.tensorrt import EngineRunner

        say(f"loading the TensorRT engine {engine}")
        runner = EngineRunner(engine, plugin=plugin)
        checks.append(_engine_check(runner, graph_inputs, output_names, nodes))
    backends = (BACKEND_REPLACED, BACKEND_ORT) + ((BACKEND_TRT,) if runner is not None else ())

    axes = symbolic
    sizes = _inputs.label_sizes(inputs, axes)
    kinds = _label_kinds(axes)
    k_base = reduction_length(reference, inputs, axes)
    rtol_example = tolerance(dtype, k_base)
    cases_out: List[CaseResult] = []
    notes = [f"replaced {replacement.num_replaced} attention layer(s) in the PyTorch copy"
             + (" (transformers layers: routed to the operator)" if replacement.to_dict()["num_routed"] else "")]
    if is_hf and _hf.valid_token_mask(inputs) is not None:
        notes.append("transformers model with an attention_mask: outputs of shape [batch, seq, ...] are compared "
                     "at valid tokens only (attention_mask != 0); padded positions are not compared")
    if not axes:
        notes.append("the ONNX graph has no symbolic input axis: only the example shape is checked")
    seen_shapes = []
    for case_name, overrides in shape_cases(sizes, kinds):
        case_inputs = inputs if not overrides else _inputs.resize(inputs, axes, {**sizes, **overrides}, seed=seed)
        shapes = _inputs.describe(case_inputs)
        if shapes in seen_shapes:
            notes.append(f"case {case_name} skipped: same shapes as an earlier case")
            continue
        seen_shapes.append(shapes)
        say(f"case {case_name}: {shapes}")
        k = reduction_length(reference, case_inputs, axes)
        rtol = tolerance(dtype, k)
        try:
            with _ReferenceMode():
                ref = _run_torch(reference, _inputs.cast_floats(case_inputs, torch.float32))
        except Exception as exc:  # noqa: BLE001
            for backend in backends:
                cases_out.append(CaseResult(case_name, backend, "*", shapes, "skipped", False,
                                            message=f"the original model rejects these shapes: {_first_line(exc)}"))
            continue
        if len(ref) != len(output_names):
            raise InputError(f"the model returns {len(ref)} tensors but the ONNX graph has {len(output_names)} outputs")
        baseline = None
        if baseline_model is not None:
            try:
                with _ReferenceMode():
                    baseline = _run_torch(baseline_model, _inputs.cast_floats(case_inputs, dtype))
            except Exception:  # noqa: BLE001 - the baseline is diagnostic only
                baseline = None
        for backend in backends:
            if backend == BACKEND_ORT and session is None:
                continue  # reported once below
            if backend == BACKEND_TRT:
                outside = runner.outside_profile({n: case_inputs[n] for n in graph_inputs})
                if outside:
                    cases_out.append(CaseResult(case_name, backend, "*", shapes, "skipped", False, message=outside))
                    continue
            start = time.perf_counter()
            try:
                if backend == BACKEND_REPLACED:
                    got = _run_torch(replaced, _inputs.cast_floats(case_inputs, dtype))
                elif backend == BACKEND_ORT:
                    got = _run_ort(session, onnx_model, case_inputs)
                else:
                    named = runner.run({n: case_inputs[n] for n in graph_inputs})
                    got = [named[n] for n in output_names]
                if len(got) != len(ref):
                    raise RuntimeError(f"{len(got)} outputs, the reference has {len(ref)}")
            except Exception as exc:  # noqa: BLE001
                cases_out.append(CaseResult(case_name, backend, "*", shapes, "error", False, rtol=rtol,
                                            message=_first_line(exc), seconds=time.perf_counter() - start))
                continue
            elapsed = time.perf_counter() - start
            valid_tokens = _hf.valid_token_mask(case_inputs) if is_hf else None
            for i, (name, a, e) in enumerate(zip(output_names, got, ref)):
                valid = _positions(valid_tokens, e)
                r = compare(a, e, rtol, valid=valid)
                base_err = None
                if baseline is not None and i < len(baseline) and e.dtype.is_floating_point:
                    b = compare(baseline[i], e, rtol, valid=valid)
                    base_err = b["max_rel_err"]
                cases_out.append(CaseResult(
                    case_name, backend, name, shapes, "passed" if r["passed"] else "failed", bool(r["passed"]),
                    max_abs_err=r["max_abs_err"], max_rel_err=r["max_rel_err"], atol=r["atol"],
                    rtol=rtol if e.dtype.is_floating_point else 0.0, nan_mismatch=r["nan_mismatch"],
                    baseline_err=base_err, message=r["message"], seconds=elapsed,
                ))
    if session_error:
        cases_out.append(CaseResult("all", BACKEND_ORT, "*", {}, "error", False, message=session_error))
    env = environment(seed)
    if runner is not None:
        from attn_export.tensorrt import environment as trt_environment

        ran = [c for c in cases_out if c.backend == BACKEND_TRT and c.status != "skipped"]
        checks.append(CheckResult(
            "tensorrt coverage", bool(ran),
            f"{len({c.case for c in ran})} case(s) ran in TensorRT" if ran else
            "no case ran in TensorRT (see the skipped cases: shapes outside the engine's optimization profile "
            "need an engine built with wider --min-shapes/--max-shapes)",
        ))
        env.update(trt_environment())
        env["engine"] = str(engine)
        env["plugin_library"] = runner.plugin_library.path if runner.plugin_library else None
        env["plugin_sha256"] = runner.plugin_library.sha256 if runner.plugin_library else None
    return ValidationReport(
        cases=cases_out, checks=checks, dtype=dtype_name,
        tolerance={
            "rule": "pass iff max|actual - reference| <= rtol * max|reference| and no NaN/inf where the "
                    "reference is finite; rtol = factor * eps(dtype) * sqrt(K)",
            "factor": TOLERANCE_FACTOR, "eps": torch.finfo(dtype).eps, "reduction_length_example": k_base,
            "rtol_example": rtol_example, "reference": "original PyTorch model, float32, eval, fast paths off",
        },
        environment=env, onnx_path=str(onnx_path), input_names=list(inputs),
        output_names=output_names, notes=notes,
    )


def _engine_check(runner, graph_inputs: List[str], output_names: List[str], nodes: int) -> CheckResult:
    """The engine belongs to this ONNX file (same inputs and outputs) and ran every attention
    node as a plugin layer (as recorded beside it by build_engine)."""
    if sorted(runner.inputs) != sorted(graph_inputs) or sorted(runner.outputs) != sorted(output_names):
        return CheckResult(
            "tensorrt engine", False,
            f"the engine's inputs {runner.inputs} / outputs {runner.outputs} are not the ONNX graph's "
            f"{graph_inputs} / {output_names}: was it built from another model?",
        )
    meta = runner.metadata
    if not meta:
        return CheckResult("tensorrt engine", True, "no build record beside the engine: plugin layer count unknown")
    layers = meta.get("plugin_layers")
    ok = layers == nodes
    return CheckResult(
        "tensorrt engine", ok,
        f"{layers} FusedAttention plugin layer(s) for {nodes} node(s)"
        + ("" if ok else ": the engine does not run every node as the plugin"),
    )


def _run_ort(session, onnx_model, inputs: Mapping[str, torch.Tensor]) -> List[torch.Tensor]:
    feeds = {}
    for value in session.get_inputs():
        t = inputs[value.name]
        elem = next(v.type.tensor_type.elem_type for v in onnx_model.graph.input if v.name == value.name)
        want = _ONNX_ELEM_TO_TORCH.get(elem, t.dtype)
        if want == torch.bfloat16:
            raise RuntimeError("bfloat16 inputs cannot be fed to ONNX Runtime's Python API from numpy")
        feeds[value.name] = t.to(want).numpy()
    outs = session.run(None, feeds)
    return [torch.from_numpy(np.asarray(o)) for o in outs]


def _dtype_of_graph(onnx_model) -> str:
    for v in onnx_model.graph.input:
        elem = v.type.tensor_type.elem_type
        if elem in (1, 10, 16, 11):
            return {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}[elem]
    return "fp32"
