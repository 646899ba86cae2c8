"""The gate's inner loop: every runner against the reference on every shape case."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from attn_export import inputs as _inputs
from attn_export.errors import InputError, first_line as _first_line
from attn_export.validation.error_profile import error_profile
from attn_export.validation.report import CaseResult
from attn_export.validation.runners import Runner
from attn_export.validation.tolerances import compare

Inputs = Mapping[str, torch.Tensor]


def run_cases(
    reference: Runner,
    runners: Sequence[Runner],
    cases: Sequence[Tuple[str, Inputs]],
    output_names: List[str],
    *,
    rtol_for: Callable[[Inputs, Optional[str]], float],
    baseline: Optional[Runner] = None,
    valid_tokens_for: Callable[[Inputs], Optional[torch.Tensor]] = lambda _inputs: None,
    say: Callable[[str], None] = lambda _msg: None,
    notes: Optional[List[str]] = None,
) -> List[CaseResult]:
    """Every runner against the reference on every case, one CaseResult per output (or one
    per runner and case when it was skipped or failed to run). Cases whose shapes repeat an
    earlier case's are skipped with a note. ``rtol_for(case_inputs, precision)`` is the
    tolerance for a runner of that compute precision (Runner.precision; None: the dtype's)."""
    results: List[CaseResult] = []
    seen_shapes = []
    for case_name, case_inputs in cases:
        shapes = _inputs.describe(case_inputs)
        if shapes in seen_shapes:
            if notes is not None:
                notes.append(f"case {case_name} skipped: same shapes as an earlier case")
            continue
        seen_shapes.append(shapes)
        say(f"case {case_name}: {shapes}")
        results += _run_case(reference, runners, case_name, case_inputs, shapes, output_names, rtol_for=rtol_for,
                             baseline=baseline, valid_tokens_for=valid_tokens_for)
    return results


@dataclass
class _Case:
    """One case as every runner is compared on it: its inputs, the reference's outputs, the
    baseline's (None without one, or when it failed) and the valid-token mask."""

    name: str
    inputs: Inputs
    shapes: Dict[str, List[int]]
    ref: Sequence[torch.Tensor]
    base: Optional[Sequence[torch.Tensor]]
    valid_tokens: Optional[torch.Tensor]


def _run_case(reference: Runner, runners: Sequence[Runner], case_name: str, case_inputs: Inputs, shapes,
              output_names: List[str], *, rtol_for, baseline: Optional[Runner], valid_tokens_for) -> List[CaseResult]:
    """One case: the reference run (shapes it rejects skip the case for every runner), then
    every runner compared against it."""
    try:
        ref = reference.run(case_inputs)
    except Exception as exc:  # noqa: BLE001
        return [CaseResult(case_name, runner.name, "*", shapes, "skipped", False,
                           message=f"the original model rejects these shapes: {_first_line(exc)}")
                for runner in runners]
    if len(ref) != len(output_names):
        raise InputError(f"the model returns {len(ref)} tensors but the ONNX graph has {len(output_names)} outputs")
    case = _Case(case_name, case_inputs, shapes, ref, _baseline_outputs(baseline, case_inputs),
                 valid_tokens_for(case_inputs))
    results: List[CaseResult] = []
    for runner in runners:
        results += _run_runner(runner, case, output_names, rtol_for(case_inputs, runner.precision))
    return results


def _baseline_outputs(baseline: Optional[Runner], case_inputs: Inputs):
    if baseline is None:
        return None
    try:
        return baseline.run(case_inputs)
    except Exception:  # noqa: BLE001 - the baseline is diagnostic only
        return None


def _run_runner(runner: Runner, case: _Case, output_names: List[str], rtol: float) -> List[CaseResult]:
    """One runner on one case: skipped (outside what it can run), an error (it failed or gave
    the wrong number of outputs), or one result per output."""
    skip = runner.skip_reason(case.inputs)
    if skip:
        return [CaseResult(case.name, runner.name, "*", case.shapes, "skipped", False, message=skip)]
    start = time.perf_counter()
    try:
        got = runner.run(case.inputs)
        if len(got) != len(case.ref):
            raise RuntimeError(f"{len(got)} outputs, the reference has {len(case.ref)}")
    except Exception as exc:  # noqa: BLE001
        crash = getattr(exc, "crash", None)
        return [CaseResult(case.name, runner.name, "*", case.shapes, "error", False, rtol=rtol,
                           message=_first_line(exc), seconds=time.perf_counter() - start,
                           crash=crash.to_dict() if crash is not None else None)]
    elapsed = time.perf_counter() - start
    return [_compare_output(runner.name, case, i, name, a, e, rtol, elapsed)
            for i, (name, a, e) in enumerate(zip(output_names, got, case.ref))]


def _compare_output(runner_name: str, case: _Case, i: int, name: str, a: torch.Tensor, e: torch.Tensor,
                    rtol: float, elapsed: float) -> CaseResult:
    """Output ``i`` (``a``) against the reference's (``e``), at the valid positions; the
    baseline's error beside it."""
    valid = _positions(case.valid_tokens, e)
    r = compare(a, e, rtol, valid=valid)
    base_err = None
    if case.base is not None and i < len(case.base) and e.dtype.is_floating_point:
        base_err = compare(case.base[i], e, rtol, valid=valid)["max_rel_err"]
    return CaseResult(
        case.name, runner_name, name, case.shapes, "passed" if r["passed"] else "failed", bool(r["passed"]),
        max_abs_err=r["max_abs_err"], max_rel_err=r["max_rel_err"], atol=r["atol"],
        rtol=rtol if e.dtype.is_floating_point else 0.0, nan_mismatch=r["nan_mismatch"],
        baseline_err=base_err, message=r["message"], seconds=elapsed,
        errors=error_profile(a, e, r["atol"], valid),
    )


def _positions(valid_tokens: Optional[torch.Tensor], output: torch.Tensor) -> Optional[torch.Tensor]:
    """The [B, L] valid-token mask broadcast over an output of shape [B, L, ...]; None (every
    position compared) for outputs of other shapes."""
    if valid_tokens is None or output.dim() < 2 or tuple(output.shape[:2]) != tuple(valid_tokens.shape):
        return None
    return valid_tokens.reshape(*valid_tokens.shape, *([1] * (output.dim() - 2))).expand(output.shape)
