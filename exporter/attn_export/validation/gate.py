"""``validate``: the original PyTorch model as the reference, a list of runners (the replaced
PyTorch model, ONNX Runtime, TensorRT) compared against it at several shapes."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from attn_export.surgery import transformers as _hf
from attn_export import inputs as _inputs
from attn_export import shapes as _shapes
from attn_export.errors import InputError, first_line as _first_line
from attn_export.onnx import attention_flavor, count_attention_nodes, output_names_for, read_metadata
from attn_export.surgery.replace import replace_attention
from attn_export.validation import checks as _checks
from attn_export.validation.report import CaseResult, CheckResult, ValidationReport, environment
from attn_export.options import GateOptions, OrtOptions, pop_legacy_ort, with_fields
from attn_export.validation.isolation import DEFAULT_TIMEOUT_S
from attn_export.validation.providers import (
    CPU_SETUP,
    ProviderSetup,
    environment_entry,
    provider_setups,
)
from attn_export.validation.runners import (
    BACKEND_REFERENCE,
    BACKEND_REPLACED,
    ORT_LEVELS,
    OnnxRuntimeRunner,
    Runner,
    RunnerError,
    TensorRTRunner,
    TorchRunner,
    prestart_onnxruntime,
)
from attn_export.validation.cases import run_cases
from attn_export.cache_contract import CacheContract, generates
from attn_export.validation.generation_gate import validate_generation, wrapped_decoder
from attn_export.validation.tolerances import TOLERANCE_FACTOR, reduction_length, tolerance

DTYPE_FROM_NAME = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
_ELEM_TO_DTYPE_NAME = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}

Inputs = Mapping[str, torch.Tensor]


def validate(model: nn.Module, onnx_path: str | Path, example_inputs: Mapping[str, torch.Tensor], *,
             dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None, engine: Optional[str | Path] = None,
             plugin: Optional[str | Path] = None, ort: Optional[OrtOptions] = None, gate: Optional[GateOptions] = None,
             progress: Optional[Callable[[str], None]] = None, **fields) -> ValidationReport:
    """Runs the original model (float32 reference), the replaced model, ONNX Runtime and, with
    ``engine``, a TensorRT engine built from ``onnx_path``, at the example shape, batch 1,
    sequence 1, an odd and a longer sequence, and compares every output.

    Args:
        model: the ORIGINAL model (not modified; copies are made).
        onnx_path: the exported file.
        example_inputs: name -> tensor, as for export.
        dynamic_axes: the axes that must be symbolic in the graph; default: what the exporter
            recorded in the file's metadata, else dim 0 and 1 of every input.
        engine: a TensorRT engine of ``onnx_path`` (attn_export.tensorrt.build_engine); needs
            TensorRT and a GPU (TensorRTUnavailable otherwise). Shapes outside its optimization
            profile are reported as skipped; at least one case must run.
        plugin: the FusedAttention plugin library for the engine and for ONNX Runtime's TensorRT
            provider (default: as attn_export.tensorrt.find_plugin_library looks for it).
        ort: ONNX Runtime's execution providers (attn_export.options.OrtOptions; default the
            CPU), each its own backend row, in this order (providers.py). A provider this ONNX
            Runtime lacks, or a GPU provider with no GPU, raises ProviderUnavailable (exit 2)
            saying what to install; a session that silently fell back to the CPU is a failed row.
        gate: how the gate runs (attn_export.options.GateOptions: the seed of the generated
            inputs, the runtimes' timeout, the generation gate's tokens, ...); ``fields``, its
            fields as keywords (``seed=1``, ``new_tokens=4``), are applied over it. The former
            ``ort_providers=``, ``ort_trt_cache_dir=``, ``ort_trt_fp16=`` still work (deprecated).
        progress: called with a short description before each step.

    A cached export (its cache's contract in the file's metadata) is checked by generating
    ``gate.new_tokens`` greedy tokens through ONNX Runtime (and ``engine``) with its cache
    against ``model.generate()`` instead of the shape cases (validation/generation_gate.py;
    ``example_inputs`` are then not used): with ``gate.generation`` None so when the file is a
    cached export and ``model`` generates (attn_export.cache_contract.generates); True: the
    file must be a cached export (InputError otherwise); False: the shape cases whatever the
    file. A cached export not checked by generating runs the shape cases through the decoder
    wrapped with its cache as flat tensors, after a non-empty past.

    A runtime that crashes (a signal), dies or hangs while it loads or runs the model is a
    failed case that says which runtime, which step, the signal or timeout and the
    optimization level; for ONNX Runtime the report's ``diagnosis`` then says at which lower
    optimization levels the model loads and runs.
    """
    ort = pop_legacy_ort(fields, ort, "validate") or OrtOptions()
    gate = with_fields(GateOptions, gate, fields, "validate")
    seed, runtime_timeout_s, isolate = gate.seed, gate.runtime_timeout_s, gate.isolate
    say = progress or (lambda _msg: None)
    onnx_path = Path(onnx_path)
    onnx_model = _load_onnx(onnx_path)
    contract = CacheContract.from_metadata(onnx_model)
    if _checked_by_generating(gate.generation, contract, model):
        return validate_generation(model, onnx_path, onnx_model, say=say, engine=engine, plugin=plugin,
                                   ort=ort, gate=gate)
    cached_notes = []
    if contract is not None:  # a cached export checked by the shape cases
        model, example_inputs, note = wrapped_decoder(model, example_inputs, contract.dtype, seed)
        cached_notes.append(note)
    prestart_onnxruntime(runtime_timeout_s)  # its process imports ONNX Runtime while PyTorch runs below
    setups = provider_setups(ort.providers, onnx_model, timeout_s=runtime_timeout_s, plugin=plugin,
                             trt_cache_dir=ort.trt_cache_dir, trt_fp16=ort.trt_fp16)
    with contextlib.ExitStack() as open_runners:
        ort_runners = [open_runners.enter_context(OnnxRuntimeRunner(onnx_path, setup, timeout_s=runtime_timeout_s))
                       for setup in setups]
        plan = _prepare(model, onnx_path, onnx_model, example_inputs, dynamic_axes=dynamic_axes, seed=seed, say=say)
        plan.notes += cached_notes
        _open_runners(plan, ort_runners, open_runners, engine=engine, plugin=plugin, isolate=isolate,
                      timeout_s=runtime_timeout_s, say=say)
        results = _run_shape_cases(plan, say) + plan.load_errors
    # The runners are closed: a diagnosis starts fresh ONNX Runtime processes of its own.
    return _report(plan, results, ort_runners, engine=engine, seed=seed, timeout_s=runtime_timeout_s, say=say)


def _checked_by_generating(generation: Optional[bool], contract: Optional[CacheContract], model: nn.Module) -> bool:
    """Whether the file is checked by generating rather than by the shape cases (``validate``'s
    ``generation``): by default, a cached export of a model that generates."""
    return bool(generation) or (generation is None and contract is not None and generates(model))


def _run_shape_cases(plan: _Plan, say) -> List[CaseResult]:
    """Every shape case through every loaded runner, against the reference, each at the
    tolerance of the file's dtype and the case's reduction length."""
    return run_cases(
        plan.reference, plan.runners, plan.cases, plan.output_names,
        rtol_for=lambda case_inputs, precision: tolerance(
            plan.dtype, reduction_length(plan.reference.model, case_inputs, plan.axes), precision),
        baseline=plan.baseline, valid_tokens_for=_hf.valid_token_mask if plan.is_hf else (lambda _inputs: None),
        say=say, notes=plan.notes,
    )


@dataclasses.dataclass
class _Plan:
    """What the gate runs: the reference, the runners, the cases, and what the report says
    about the file before any case runs."""

    onnx_path: Path
    onnx_model: object
    dtype_name: str
    dtype: torch.dtype
    graph_inputs: List[str]
    reference: TorchRunner
    inputs: Dict[str, torch.Tensor]
    output_names: List[str]
    axes: Dict[str, Dict[int, str]]
    checks: List[CheckResult]
    replaced: nn.Module
    replacement: object  # ReplacementReport
    baseline: Optional[TorchRunner]
    is_hf: bool
    cases: List[Tuple[str, Inputs]] = dataclasses.field(default_factory=list)
    notes: List[str] = dataclasses.field(default_factory=list)
    runners: List[Runner] = dataclasses.field(default_factory=list)
    load_errors: List[CaseResult] = dataclasses.field(default_factory=list)
    trt_runner: Optional[TensorRTRunner] = None


def _prepare(model, onnx_path: Path, onnx_model, example_inputs, *, dynamic_axes, seed, say) -> _Plan:
    """The file read, the reference run at the example shape, the graph checks, the replaced
    copy and the shape cases."""
    meta = read_metadata(onnx_model)
    init_names = {i.name for i in onnx_model.graph.initializer}
    graph_inputs = [v.name for v in onnx_model.graph.input if v.name not in init_names]
    dtype_name = meta.get("dtype") or _dtype_of_graph(onnx_model)
    dtype = DTYPE_FROM_NAME.get(dtype_name, torch.float32)

    reference = TorchRunner(BACKEND_REFERENCE, _prepared(model).float(), torch.float32, fast_paths=False)
    inputs = _inputs.order_for_model(reference.model, example_inputs)
    missing = [n for n in graph_inputs if n not in inputs]
    if missing:
        raise InputError(f"the ONNX graph needs input(s) {', '.join(missing)} that were not given (inputs: {', '.join(inputs)})")
    say("running the original model at the example shape")
    try:
        with torch.no_grad():
            example_out = _example_outputs(reference, inputs)
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"the model rejected the example inputs {_inputs.describe(inputs)}: {_first_line(exc)}") from exc
    output_names = json.loads(meta["output_names"]) if "output_names" in meta else output_names_for(example_out)

    axes = _shapes.graph_axes(onnx_model, graph_inputs)
    checks = [_checks.dynamic_axes_check(_declared_axes(dynamic_axes, meta, inputs, graph_inputs), axes)]
    checks += _checks.attention_checks(onnx_model, meta)
    replaced = _prepared(model)
    plan = _Plan(
        onnx_path=onnx_path, onnx_model=onnx_model, dtype_name=dtype_name, dtype=dtype, graph_inputs=graph_inputs,
        reference=reference, inputs=inputs, output_names=output_names, axes=axes, checks=checks,
        replaced=replaced, replacement=replace_attention(replaced, inputs), is_hf=_hf.contains_hf_model(model),
        baseline=TorchRunner(f"pytorch-{dtype_name}", _prepared(model).to(dtype), dtype, fast_paths=False)
        if dtype in (torch.float16, torch.bfloat16) else None)
    plan.notes = _notes(plan)
    sizes = _inputs.label_sizes(inputs, axes)
    plan.cases = [(name, inputs if not overrides else _inputs.resize(inputs, axes, {**sizes, **overrides}, seed=seed))
                  for name, overrides in _shapes.shape_cases(sizes, _shapes.label_kinds(axes))]
    return plan


def _notes(plan: _Plan) -> List[str]:
    notes = [f"replaced {plan.replacement.num_replaced} attention layer(s) in the PyTorch copy"
             + (" (transformers layers: routed to the operator)" if plan.replacement.to_dict()["num_routed"] else "")]
    if plan.is_hf and _hf.valid_token_mask(plan.inputs) is not None:
        notes.append("transformers model with an attention_mask: outputs of shape [batch, seq, ...] are compared "
                     "at valid tokens only (attention_mask != 0); padded positions are not compared")
    if not plan.axes:
        notes.append("the ONNX graph has no symbolic input axis: only the example shape is checked")
    return notes


def _open_runners(plan: _Plan, ort_runners, open_runners: contextlib.ExitStack, *, engine, plugin, isolate,
                  timeout_s, say) -> None:
    """The backends under test, loaded, in report order: the replaced model, each ONNX Runtime
    provider, the engine. One that cannot load is a failed case of its own."""
    plan.runners = [open_runners.enter_context(TorchRunner(BACKEND_REPLACED, plan.replaced.to(plan.dtype), plan.dtype))]
    for ort_runner in ort_runners:
        say(f"loading the ONNX model in ONNX Runtime ({ort_runner.setup.provider})")
        try:
            ort_runner.load()
            plan.runners.append(ort_runner)
        except RunnerError as exc:
            plan.load_errors.append(_load_error(ort_runner.name, exc))
    if engine is None:
        return
    say(f"loading the TensorRT engine {engine}")
    try:
        trt_runner = TensorRTRunner(engine, plugin, plan.graph_inputs, plan.output_names, isolate=isolate,
                                    timeout_s=timeout_s)
    except RunnerError as exc:  # TensorRT crashed or hung while deserializing the engine
        plan.load_errors.append(_load_error(TensorRTRunner.name, exc))
        return
    plan.trt_runner = open_runners.enter_context(trt_runner)
    plan.checks.append(_checks.engine_check(trt_runner.engine, plan.graph_inputs, plan.output_names,
                                            count_attention_nodes(plan.onnx_model)))
    plan.runners.append(trt_runner)


def _report(plan: _Plan, results: List[CaseResult], ort_runners, *, engine, seed, timeout_s, say) -> ValidationReport:
    """The report: the cases, the checks, a diagnosis when ONNX Runtime crashed, the environment
    and the tolerance rule."""
    notes, checks = plan.notes, plan.checks
    diagnosis = {}
    crashed = [r for r in ort_runners if any(c.crash and c.backend == r.name for c in results)]
    if crashed:
        say("ONNX Runtime crashed: trying lower optimization levels")
        diagnosis = diagnose_onnxruntime(plan.onnx_path, plan.inputs, timeout_s, setup=crashed[0].setup)
        notes.append(diagnosis["summary"])
    notes += [f"{r.name}: {note}" for r in ort_runners for note in r.setup.notes]

    env = environment(seed, providers=[r.setup.provider for r in ort_runners],
                      onnxruntime_version=next((r.version for r in ort_runners if r.version), None))
    env["onnxruntime_optimization_level"] = ort_runners[0].optimization_level
    env["onnxruntime_execution_providers"] = [environment_entry(r.setup, r.session_providers) for r in ort_runners]
    if engine is not None:
        from attn_export.tensorrt import environment as trt_environment

        checks.append(_checks.tensorrt_coverage_check(results))
        library = plan.trt_runner.engine.plugin_library if plan.trt_runner is not None else None
        env.update(trt_environment())
        env.update(engine=str(engine), plugin_library=library.path if library else None,
                   plugin_sha256=library.sha256 if library else None)
    k_base = reduction_length(plan.reference.model, plan.inputs, plan.axes)
    return ValidationReport(
        cases=results, checks=checks, dtype=plan.dtype_name,
        tolerance={
            "rule": "pass iff max|actual - reference| <= rtol * max|reference| and no NaN/inf where the "
                    "reference is finite; rtol = factor * eps(dtype) * sqrt(K)",
            "factor": TOLERANCE_FACTOR, "eps": torch.finfo(plan.dtype).eps, "reduction_length_example": k_base,
            "rtol_example": tolerance(plan.dtype, k_base), "reference": "original PyTorch model, float32, eval, fast paths off",
            "compute_precision": {r.name: r.precision for r in ort_runners if r.precision},
        },
        environment=env, onnx_path=str(plan.onnx_path), input_names=list(plan.inputs),
        output_names=plan.output_names, notes=notes, diagnosis=diagnosis, coverage=plan.replacement.to_dict(),
        attention_flavor=attention_flavor(plan.onnx_model),  # the file is loaded already: not again in the report
    )


def _load_error(backend: str, exc: RunnerError) -> CaseResult:
    return CaseResult("all", backend, "*", {}, "error", False, message=str(exc),
                      crash=exc.crash.to_dict() if exc.crash is not None else None)


def diagnose_onnxruntime(onnx_path: Path, inputs: Inputs, timeout_s: float = DEFAULT_TIMEOUT_S,
                         setup: Optional[ProviderSetup] = None) -> Dict[str, object]:
    """Loads and runs the model (example inputs) at each ONNX Runtime optimization level, each
    in a fresh process: which levels work says whether a graph optimization pass is at fault
    and what users can set until the runtime or the model is fixed."""
    levels: Dict[str, str] = {}
    for level in ORT_LEVELS:
        runner = OnnxRuntimeRunner(onnx_path, setup, optimization_level=level, timeout_s=timeout_s)
        try:
            runner.load()
            runner.run(inputs)
            levels[level] = "ok"
        except RunnerError as exc:
            levels[level] = str(exc) if exc.crash is None else exc.crash.describe()
        except Exception as exc:  # noqa: BLE001 - e.g. inputs ONNX Runtime cannot take
            levels[level] = _first_line(exc)
        finally:
            runner.close()
    working = [lvl for lvl, verdict in levels.items() if verdict == "ok"]
    if not working:
        summary = "diagnosis: ONNX Runtime fails at every optimization level (" + \
            "; ".join(f"{lvl}: {v}" for lvl, v in levels.items()) + ")"
    elif ORT_LEVELS[0] in working:
        summary = (f"diagnosis: a fresh ONNX Runtime process loads and runs the model at {ORT_LEVELS[0]}: "
                   "the failure depends on the case's shapes or is intermittent")
    else:
        summary = (f"diagnosis: ONNX Runtime fails at {', '.join(l for l in ORT_LEVELS if l not in working)} "
                   f"but loads and runs the model at {', '.join(working)}: a graph optimization pass of the higher "
                   f"level is at fault. Workaround for users: SessionOptions.graph_optimization_level = "
                   f"{working[0]}; please report the model")
    return {"runtime": "onnxruntime", "provider": (setup or CPU_SETUP).provider, "levels": levels, "working_levels": working, "summary": summary}


def _load_onnx(onnx_path: Path):
    import onnx

    if not onnx_path.is_file():
        raise InputError(f"{onnx_path}: no such file")
    try:
        return onnx.load(str(onnx_path))
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{onnx_path}: not a readable ONNX file ({_first_line(exc)})") from exc


def _example_outputs(reference: TorchRunner, inputs: Inputs):
    """The reference's outputs at the example shape, unflattened (their structure names the
    ONNX outputs of a file that does not record them)."""
    from attn_export.validation.runners import FastPathsOff

    with FastPathsOff():
        return reference.model(**_inputs.cast_floats(inputs, torch.float32))


def _declared_axes(dynamic_axes, meta: Dict[str, str], inputs: Inputs, graph_inputs: List[str]):
    """The axes that must be symbolic: as given, else as the exporter recorded, else dim 0 and 1."""
    if dynamic_axes is not None:
        return {n: dict(d) for n, d in dynamic_axes.items() if d}
    if "dynamic_axes" in meta:
        return {n: {int(a): lbl for a, lbl in d.items()} for n, d in json.loads(meta["dynamic_axes"]).items()}
    return _inputs.default_axes({n: inputs[n] for n in graph_inputs})


def _prepared(model: nn.Module) -> nn.Module:
    """An eval-mode copy; transformers models without their key/value cache in the outputs
    (as exported)."""
    copied = copy.deepcopy(model).eval()
    if _hf.contains_hf_model(copied):
        _hf.prepare_for_export(copied)
    return copied


def _dtype_of_graph(onnx_model) -> str:
    for v in onnx_model.graph.input:
        name = _ELEM_TO_DTYPE_NAME.get(v.type.tensor_type.elem_type)
        if name:
            return name
    return "fp32"
