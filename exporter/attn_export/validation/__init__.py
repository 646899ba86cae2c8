"""The parity gate: the original PyTorch model against the replaced PyTorch model, ONNX
Runtime and (given an engine) TensorRT, at several shapes, with tolerances derived from the
dtype (docs/validation.md).

    >>> report = attn_export.validate(model, "model.onnx", {"src": x})
    >>> report = attn_export.validate(model, "model.onnx", {"src": x}, engine="model.engine")
    >>> report.passed, report.to_json(), report.to_junit_xml()

Cases: the example shape, batch 1, sequence 1, an odd sequence length and a longer one (per
symbolic axis of the ONNX graph; axes the graph ties together keep one size; see
attn_export.shapes). Graph checks: every axis declared dynamic is symbolic in the ONNX graph,
the attention nodes and their function are there.

Modules: ``runners`` (one class per backend), ``providers`` (ONNX Runtime's execution
providers: which, available or not, their session options), ``gate`` (validate: the runners against the
reference), ``tolerances`` (the comparison rule), ``checks`` (graph and engine checks),
``report`` (results and their renderings), ``generation`` (a cached export: greedy generation
with the cache against ``generate()``; ``generation_gate`` makes its report).
"""
from attn_export.shapes import graph_axes, label_kinds, shape_cases
from attn_export.validation.gate import run_cases, validate
from attn_export.validation.generation import check_generation
from attn_export.validation.generation_result import GenerationResult
from attn_export.validation.providers import ProviderSetup, ProviderUnavailable
from attn_export.validation.report import CaseResult, CheckResult, ValidationReport, environment
from attn_export.validation.runners import (
    BACKEND_ORT,
    BACKEND_REFERENCE,
    BACKEND_REPLACED,
    BACKEND_TRT,
    OnnxRuntimeRunner,
    Runner,
    RunnerError,
    TensorRTRunner,
    TorchRunner,
)
from attn_export.validation.tolerances import TOLERANCE_FACTOR, compare, reduction_length, tolerance

__all__ = [
    "validate", "run_cases", "check_generation", "GenerationResult", "ValidationReport", "CaseResult", "CheckResult", "environment",
    "Runner", "RunnerError", "TorchRunner", "OnnxRuntimeRunner", "TensorRTRunner", "ProviderSetup",
    "ProviderUnavailable",
    "BACKEND_REFERENCE", "BACKEND_REPLACED", "BACKEND_ORT", "BACKEND_TRT",
    "TOLERANCE_FACTOR", "compare", "reduction_length", "tolerance",
    "graph_axes", "label_kinds", "shape_cases",
]
