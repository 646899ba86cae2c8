"""Tolerances derived from the dtype and the reduction length, and the comparison rule
(docs/validation.md): pass iff max|actual - expected| <= rtol * max|expected| and no NaN/inf
where the reference is finite."""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

import numpy as np
import torch
from torch import nn

from attn_export import inputs as _inputs

# rtol = TOLERANCE_FACTOR * eps(dtype) * sqrt(K); see docs/validation.md.
TOLERANCE_FACTOR = 8.0
# A backend that computes float32 matmuls at lower precision (providers.ProviderSetup.precision):
# TF32 keeps 10 mantissa bits (cuBLAS and TensorRT on Ampere and later, by default), as float16.
COMPUTE_EPS = {"tf32": 2.0 ** -10, "fp16": torch.finfo(torch.float16).eps, "bf16": torch.finfo(torch.bfloat16).eps}
# A backend that rounds a matmul's inputs only and sums the products exactly (integers): ONNX
# Runtime's MatMulNBits at accuracy_level 4 (a --quantize export on the CPU) rounds each block of
# activations to int8, the spacing 1/127 of the block's largest magnitude, and accumulates in
# int32. No partial sum is rounded, so the error relative to the output's scale does not grow
# with K: rtol = TOLERANCE_FACTOR * spacing (docs/validation.md, "Quantized exports").
INPUT_ROUNDING = {"int8": 1.0 / 127}

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


def tolerance(dtype: torch.dtype, k: int, precision: Optional[str] = None) -> float:
    """rtol = TOLERANCE_FACTOR * eps * sqrt(K), relative to the output's largest magnitude; eps is
    the dtype's, or the backend's compute ``precision`` ("tf32", "fp16") where that is coarser. A
    ``precision`` that rounds the inputs only ("int8", INPUT_ROUNDING): TOLERANCE_FACTOR * its
    spacing, where that is larger than the dtype's rule."""
    if precision in INPUT_ROUNDING:
        return max(tolerance(dtype, k), TOLERANCE_FACTOR * INPUT_ROUNDING[precision])
    eps = max(torch.finfo(dtype).eps, COMPUTE_EPS[precision] if precision else 0.0)
    return TOLERANCE_FACTOR * eps * math.sqrt(max(k, 1))


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

