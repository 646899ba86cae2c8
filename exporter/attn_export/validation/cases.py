"""The gate's inner loop: every runner against the reference on every shape case."""
from __future__ import annotations

import time
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

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
        try:
            ref = reference.run(case_inputs)
        except Exception as exc:  # noqa: BLE001
            for runner in runners:
                results.append(CaseResult(case_name, runner.name, "*", shapes, "skipped", False,
                                          message=f"the original model rejects these shapes: {_first_line(exc)}"))
            continue
        if len(ref) != len(output_names):
            raise InputError(f"the model returns {len(ref)} tensors but the ONNX graph has {len(output_names)} outputs")
        base = None
        if baseline is not None:
            try:
                base = baseline.run(case_inputs)
            except Exception:  # noqa: BLE001 - the baseline is diagnostic only
                base = None
        valid_tokens = valid_tokens_for(case_inputs)
        for runner in runners:
            rtol = rtol_for(case_inputs, runner.precision)
            skip = runner.skip_reason(case_inputs)
            if skip:
                results.append(CaseResult(case_name, runner.name, "*", shapes, "skipped", False, message=skip))
                continue
            start = time.perf_counter()
            try:
                got = runner.run(case_inputs)
                if len(got) != len(ref):
                    raise RuntimeError(f"{len(got)} outputs, the reference has {len(ref)}")
            except Exception as exc:  # noqa: BLE001
                crash = getattr(exc, "crash", None)
                results.append(CaseResult(case_name, runner.name, "*", shapes, "error", False, rtol=rtol,
                                          message=_first_line(exc), seconds=time.perf_counter() - start,
                                          crash=crash.to_dict() if crash is not None else None))
                continue
            elapsed = time.perf_counter() - start
            for i, (name, a, e) in enumerate(zip(output_names, got, ref)):
                valid = _positions(valid_tokens, e)
                r = compare(a, e, rtol, valid=valid)
                base_err = None
                if base is not None and i < len(base) and e.dtype.is_floating_point:
                    base_err = compare(base[i], e, rtol, valid=valid)["max_rel_err"]
                results.append(CaseResult(
                    case_name, runner.name, name, shapes, "passed" if r["passed"] else "failed", bool(r["passed"]),
                    max_abs_err=r["max_abs_err"], max_rel_err=r["max_rel_err"], atol=r["atol"],
                    rtol=rtol if e.dtype.is_floating_point else 0.0, nan_mismatch=r["nan_mismatch"],
                    baseline_err=base_err, message=r["message"], seconds=elapsed,
                    errors=error_profile(a, e, r["atol"], valid),
                ))
    return results


def _positions(valid_tokens: Optional[torch.Tensor], output: torch.Tensor) -> Optional[torch.Tensor]:
    """The [B, L] valid-token mask broadcast over an output of shape [B, L, ...]; None (every
    position compared) for outputs of other shapes."""
    if valid_tokens is None or output.dim() < 2 or tuple(output.shape[:2]) != tuple(valid_tokens.shape):
        return None
    return valid_tokens.reshape(*valid_tokens.shape, *([1] * (output.dim() - 2))).expand(output.shape)
