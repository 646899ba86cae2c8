"""What the Hopper (sm_90a) GPU tests share: whether the sm_90a kernels are dispatched in this
process, and which CUDA kernels a call launched (so that no test passes on the sm80 path by accident)."""
from __future__ import annotations

import os

import pytest
import torch


def skip_reason(kernel: str) -> str | None:
    """Why `kernel` (e.g. "the sm_90a forward") cannot run here, or None where it is dispatched."""
    if not torch.cuda.is_available():
        return "needs a GPU"
    if torch.cuda.get_device_capability(0)[0] != 9:
        return f"{kernel} runs on compute capability 9 only"
    if os.environ.get("ATTN_EXPORT_CUDA_PREVIEW") != "1" or os.environ.get("ATTN_EXPORT_CUDA_SM90") != "1":
        return f"{kernel} is dispatched only with ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1"
    from attn_export import _build_info
    if "9.0a" not in (_build_info.CUDA_ARCHS or ""):
        return f"attn_export was built for {_build_info.CUDA_ARCHS!r}; {kernel} needs 9.0a"
    return None


def kernels_run(fn, kernel: str) -> set[str]:
    """Names of the CUDA kernels fn() launched; skips the test where `kernel` cannot run (a call,
    not a skipif mark, so that tests/run_without_pytest.py skips it too)."""
    reason = skip_reason(kernel)
    if reason is not None:
        pytest.skip(reason)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA}


def nan_padded(batch: int, heads: int, seqlen: int, dim: int, dtype, layout: str = "bhld") -> torch.Tensor:
    """Random [batch, heads, seqlen, dim] values viewed in a larger buffer whose rows just past each
    (batch, head)'s seqlen hold NaN: "bhld" keeps each head's rows together (head stride (seqlen + 5)
    rows), "blhd" is token-major (the layer's projections; head stride dim, row stride heads x dim).
    A TMA box past a sequence's end must be zero-filled by the copy engine; one that read the rows
    behind it (the next head's, the next batch's, or these NaN) puts NaN in the results."""
    pad = 5
    if layout == "bhld":
        buf = torch.full((batch, heads, seqlen + pad, dim), float("nan"), dtype=dtype, device="cuda")
        view = buf[:, :, :seqlen]
    else:
        buf = torch.full((batch, seqlen + pad, heads, dim), float("nan"), dtype=dtype, device="cuda")
        view = buf[:, :seqlen].transpose(1, 2)
    view.copy_(torch.randn(batch, heads, seqlen, dim, dtype=dtype, device="cuda"))
    return view
