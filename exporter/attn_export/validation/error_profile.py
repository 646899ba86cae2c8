"""How the errors of one output spread, for the HTML report: a histogram of
|actual - expected| / atol over fixed bins, and the worst elements with their positions."""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch

# Bin edges of log10(|actual - expected| / atol): one decade per bin from 1e-8 to 1e3, with
# underflow (exact matches included) and overflow bins. A ratio above 1 (log10 > 0) fails.
LOG10_EDGES = list(range(-8, 4))
WORST = 5


def error_profile(actual: torch.Tensor, expected: torch.Tensor, atol: Optional[float],
                  valid: Optional[torch.Tensor] = None) -> Optional[Dict[str, object]]:
    """``{"log10_edges", "counts", "worst": [{"index", "actual", "expected", "ratio"}]}`` for a
    floating output compared with tolerance ``atol`` (see tolerances.compare); None when there is
    nothing to profile (shapes differ, not floating, no tolerance). Positions where the reference
    is not finite are left out; a NaN/inf of ``actual`` where the reference is finite counts as an
    infinite error."""
    if atol is None or atol <= 0 or tuple(actual.shape) != tuple(expected.shape) \
            or not expected.dtype.is_floating_point:
        return None
    a = actual.detach().double().cpu().numpy()
    e = expected.detach().double().cpu().numpy()
    keep = np.isfinite(e)
    if valid is not None:
        keep &= valid.cpu().numpy().astype(bool)
    with np.errstate(invalid="ignore"):
        ratio = np.where(np.isfinite(a), np.abs(a - e), np.inf) / atol
    ratio = np.where(keep, ratio, np.nan)
    kept = ratio[keep]
    with np.errstate(divide="ignore"):
        logs = np.log10(kept)
    edges = [-np.inf, *LOG10_EDGES, np.inf]
    counts, _ = np.histogram(np.clip(logs, LOG10_EDGES[0] - 1, LOG10_EDGES[-1] + 1), bins=[
        LOG10_EDGES[0] - 2, *LOG10_EDGES, LOG10_EDGES[-1] + 2])
    worst: List[Dict[str, object]] = []
    if kept.size:
        flat = np.nan_to_num(ratio.ravel(), nan=-1.0, posinf=np.finfo(np.float64).max)
        for i in np.argsort(flat)[::-1][:WORST]:
            if flat[i] < 0:
                break
            index = [int(x) for x in np.unravel_index(i, ratio.shape)]
            worst.append({"index": index, "actual": float(a[tuple(index)]), "expected": float(e[tuple(index)]),
                          "ratio": float(ratio[tuple(index)])})
    return {"log10_edges": [float(x) for x in edges], "counts": [int(c) for c in counts], "worst": worst,
            "elements": int(kept.size)}
