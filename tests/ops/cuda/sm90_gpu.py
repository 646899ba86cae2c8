"""What the Hopper (sm_90a) GPU tests share: whether the sm_90a kernels are dispatched in this
process, and which CUDA kernels a call launched (so that no test passes on the sm80 path by accident)."""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda"
F16, BF16 = torch.float16, torch.bfloat16
# The head dims both Hopper kernels are compiled for (hopper/flash_fwd_sm90.h kHeadDims, flash_bwd_sm90.h kBwdTiles).
HEAD_DIMS = [32, 64, 96, 128, 192, 256]


def over_shapes(test):
    """The Hopper tests' shape sweep: dtype x head dim x causal x sequence (1, odd, a tile, past one)."""
    for mark in (pytest.mark.parametrize("seqlen", [1, 7, 97, 128, 1025]),
                 pytest.mark.parametrize("causal", [False, True]),
                 pytest.mark.parametrize("head_dim", HEAD_DIMS),
                 pytest.mark.parametrize("dtype", [F16, BF16])):
        test = mark(test)
    return test


def over_masks(test):
    """The Hopper tests' mask sweep: dtype x head dim x every mask of helpers.MASKS."""
    from helpers import MASKS

    for mark in (pytest.mark.parametrize("mask", sorted(MASKS)),
                 pytest.mark.parametrize("head_dim", HEAD_DIMS),
                 pytest.mark.parametrize("dtype", [F16, BF16])):
        test = mark(test)
    return test


def assert_ran(ran: set[str], kernel: str, what: str) -> None:
    """That a kernel whose name contains ``kernel`` (``what``: e.g. "the sm_90a forward") ran."""
    assert any(kernel in name for name in ran), f"{what} did not run; kernels: {sorted(ran)}"


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


# The sm80 forward's query tile rows (kernel_traits.h FlashFwdTraits<...>::kBlockM, every head dim).
SM80_BLOCK_M = 64


def filling_batch(batch: int, heads: int, seqlen_q: int, group: int = 1) -> int:
    """The smallest batch >= `batch` whose sm80 forward tiles fill the GPU's SMs (packed or not:
    the packed count, `heads / group` key/value heads of `group * seqlen_q` rows, is the smaller).
    There the sm80 forward would not split the keys, so the Hopper forward keeps the problem
    (forward_plan.h hopper_forward_declines) and a test of the Hopper kernel tests it."""
    if not torch.cuda.is_available():
        return batch  # the test skips in kernels_run
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = min(heads * -(-seqlen_q // SM80_BLOCK_M), heads // group * -(-group * seqlen_q // SM80_BLOCK_M))
    return max(batch, -(-sms // tiles))


def padded_batch_mask(batch: int, seqlen_k: int, device: str = "cuda") -> torch.Tensor:
    """A key-padding mask (True = padded) that cycles through the shapes a padded batch takes:
    right padding (a third of the keys visible), left padding (the last fifth visible), every key
    padded, interior holes (a hole of 40% in the middle and every 7th key), and none."""
    m = torch.zeros(batch, seqlen_k, dtype=torch.bool, device=device)
    keys = torch.arange(seqlen_k, device=device)
    for b in range(batch):
        kind = b % 5
        if kind == 0:
            m[b] = keys >= seqlen_k // 3
        elif kind == 1:
            m[b] = keys < seqlen_k - seqlen_k // 5
        elif kind == 2:
            m[b] = True
        elif kind == 3:
            m[b] = ((keys >= 3 * seqlen_k // 10) & (keys < 7 * seqlen_k // 10)) | (keys % 7 == 3)
    return m


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
