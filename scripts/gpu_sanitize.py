#!/usr/bin/env python
"""Every CUDA kernel path of the attention core once, at small odd shapes, for NVIDIA's
compute-sanitizer (scripts/gpu_check.sh runs it under memcheck, racecheck, initcheck and synccheck):

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python scripts/gpu_sanitize.py

The sanitizer sees what a test cannot: a read past a buffer that lands in other live memory, a
shared-memory race that happens to give the right numbers. PyTorch's caching allocator carves
tensors out of larger blocks, where an overrun stays inside the block and memcheck sees nothing;
without caching every tensor is its own allocation.

Lengths 67 and 131 leave partial query and key tiles on every path; the cases cover the flash
kernels (float16/bfloat16, head dims 32/64/96/128/192/256, causal or not, masks; 80 and 160
padded to the next compiled size), the generic kernels (float32, float64, a head dim off the
tensor-core list, a value head dim unlike the key's), grouped-query heads, the bottom-right causal
alignment, split-KV decoding (one query row over 2053 keys), grouped-query heads packed into one tile
(16 heads on 2, 5 query rows), key tiles skipped for left and right padding and a batch row with
no key (preview), the weights kernel and the backward of each. Only the kernels' memory behaviour is checked here; the numbers are the tests' job.

The paths not yet verified on a GPU (docs/cuda.md "Preview") run only with ATTN_EXPORT_CUDA_PREVIEW=1,
which gpu_check.sh sets for the sanitizer; without it the same cases run the verified kernels.
With ATTN_EXPORT_CUDA_SM90=1 as well, on a Hopper GPU and a 9.0a build (gpu_check.sh's `sm90` step
sets it for the steps after it), the float16/bfloat16 cases run the sm_90a kernels instead: the
backward at every head dim, the forward where the sm80 forward would neither split the keys nor
pack grouped heads (forward_plan.h). At head dims 192/256 those short keys would be split over a
batch of 2, so their `fill` cases take a batch whose query tiles fill the GPU's SMs; the
`deterministic` cases run the backward under torch.use_deterministic_algorithms (the sm_90a
backward's ordered dQ turns; elsewhere a warning, as the sm80 backward is not deterministic).

initcheck follows the writes of plain kernels (torch.randn's) but not those of cuBLAS's Hopper
GEMMs: on an H200 it reported every read of the layer's projected q and k, exactly the valid
rows, and nothing in the same kernels fed by torch.randn. `--no-layer` leaves the layer out.

    python scripts/gpu_sanitize.py [--device cpu] [--quick] [--no-layer]   # --device cpu checks the script itself
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import attn_export

ops = torch.ops.attn_export

# (dtype, head dim, value head dim, causal, spec): spec is "" or a '+'-joined subset of the masks
# padding, skip (left and right padding), nokeys (a batch row all padded), bool, float, and of gqa
# (4 query heads on 2 key/value heads), bottom_right (the causal alignment), decode (one query row
# over 2053 keys: split-KV under the preview switch), pack (16 query heads on 2 key/value heads, 5
# query rows over 2053 keys: under the preview, each group's 40 rows packed into one tile, split-KV),
# fill (a batch whose query tiles fill the SMs: no split-KV, so the sm_90a forward keeps the problem),
# wide (130 query rows, a batch whose 128-row blocks fill the SMs: under the preview the sm80
# forward's 128-row kernel, a partial second block),
# deterministic (the backward under torch.use_deterministic_algorithms(True, warn_only=True)).
CASES = [
    *[(dtype, d, d, causal, "") for dtype in (torch.float16, torch.bfloat16) for d in (32, 64, 96, 128, 192, 256)
      for causal in (False, True)],
    (torch.float16, 80, 80, True, "padding"),  # padded to the 96 kernels: loads and stores masked
    (torch.bfloat16, 160, 160, False, "bool"),  # padded to 192
    (torch.float16, 64, 64, True, "padding+float"),
    (torch.bfloat16, 128, 128, False, "bool"),
    (torch.float32, 64, 64, True, "padding+bool"),
    (torch.float64, 40, 24, False, "float"),
    (torch.float16, 36, 36, False, ""),  # not a multiple of 8: the generic kernels
    # Grouped-query heads (the binding sums dK/dV over each group) and bottom-right causality
    # (Lq < Lk here; rows without a key are the emulator's and the tests' job).
    (torch.float16, 64, 64, True, "gqa+bottom_right"),
    (torch.bfloat16, 128, 128, True, "gqa+padding"),
    (torch.float32, 64, 64, True, "gqa+bottom_right"),
    (torch.bfloat16, 128, 128, True, "gqa+bottom_right+decode"),
    (torch.float16, 64, 64, False, "padding+decode"),
    # Key tiles skipped under the preview switch (key_tile_range.cuh): right and left padding whose
    # whole tiles the kernels never load, a batch row with every key padded, split-KV over them.
    (torch.float16, 64, 64, False, "skip"),
    (torch.bfloat16, 128, 128, True, "skip+gqa+bottom_right"),
    (torch.float16, 64, 64, False, "skip+decode"),
    (torch.float16, 128, 128, False, "nokeys"),
    # Grouped-query heads packed into the forward's tiles under the preview switch (kPackGqa).
    (torch.bfloat16, 128, 128, True, "pack+bottom_right+float"),
    (torch.float16, 64, 64, False, "pack+padding"),
    # The sm_90a kernels' own paths (ATTN_EXPORT_CUDA_SM90=1): the forward at 192/256 (serial
    # schedule, fullest shared memory), the swapped backward consumer there, deterministic dQ turns.
    (torch.float16, 192, 192, True, "fill"),
    (torch.bfloat16, 256, 256, False, "fill+padding"),
    (torch.bfloat16, 256, 256, True, "fill+deterministic"),
    (torch.float16, 128, 128, True, "deterministic+gqa"),
    (torch.bfloat16, 64, 64, False, "deterministic+skip"),
    # The sm80 forward's 128-row blocks under the preview switch (kWideForwardTiles).
    (torch.float16, 64, 64, True, "wide+bottom_right"),
    (torch.bfloat16, 32, 32, False, "wide+skip"),
]
# For the slower tools (racecheck, initcheck, synccheck): the flash kernels at head dims 64 and 128
# with and without masks, and the generic kernels in float32 and at an odd head dim.
QUICK = [
    (torch.float16, 64, 64, False, ""),
    (torch.float16, 64, 64, True, "padding+float"),
    (torch.bfloat16, 128, 128, False, "bool"),
    (torch.float32, 64, 64, True, "padding+bool"),
    (torch.float16, 36, 36, False, ""),
    (torch.float16, 64, 64, True, "gqa+bottom_right"),
    (torch.bfloat16, 128, 128, True, "gqa+bottom_right+decode"),
    (torch.float16, 64, 64, False, "skip"),
    (torch.bfloat16, 128, 128, True, "pack+bottom_right+float"),
    (torch.bfloat16, 256, 256, True, "fill+deterministic"),
    (torch.float16, 128, 128, True, "deterministic+gqa"),
]
assert all(case in CASES for case in QUICK)


# The sm80 forward's query tile rows (64; 128 in its wide blocks), and the SM count assumed off a
# GPU (an H100/H200's).
SM80_BLOCK_M, SM80_WIDE_BLOCK_M, ASSUMED_SMS = 64, 128, 132


def filling_batch(heads, Lq, device, block_m=SM80_BLOCK_M):
    """The smallest batch whose sm80 query tiles of block_m rows (heads x tiles a sequence) fill the SMs."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else ASSUMED_SMS
    per_sequence = heads * -(-Lq // block_m)
    return -(-sms // per_sequence)


@contextlib.contextmanager
def deterministic_algorithms(on):
    """torch.use_deterministic_algorithms(True, warn_only=True) inside, when `on`."""
    before, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def masks_for(spec, B, Lq, Lk, dtype, device):
    masks = {}
    if "padding" in spec:
        padding = torch.zeros(B, Lk, dtype=torch.bool, device=device)
        padding[0, Lk // 2:] = True
        masks["key_padding_mask"] = padding
    if "skip" in spec:  # row 0 right-padded, row 1 left-padded: whole key tiles of each skipped
        padding = torch.zeros(B, Lk, dtype=torch.bool, device=device)
        padding[0, Lk // 3:] = True
        padding[1, : 2 * Lk // 3] = True
        masks["key_padding_mask"] = padding
    if "nokeys" in spec:  # row 1 sees no key: every tile skipped, zero output and gradients
        padding = torch.zeros(B, Lk, dtype=torch.bool, device=device)
        padding[1:] = True
        masks["key_padding_mask"] = padding
    if "bool" in spec:
        masks["attn_mask"] = torch.rand(Lq, Lk, device=device) < 0.2
    if "float" in spec:
        masks["attn_mask"] = torch.randn(1, 1, Lq, Lk, dtype=dtype, device=device)
    return masks


def run_case(dtype, d, dv, causal, spec, device, layer=True, Lq=67, Lk=131):
    """Forward and backward of the core (autograd), the weights and their gradient (the operator
    pair, its backward without the saved output, so the binding's recomputing forward runs too),
    and, with ``layer``, the layer returning weights. The names of the results that are not finite."""
    B, H, Hkv = (2, 4, 2) if "gqa" in spec else (2, 3, 3)
    if "fill" in spec:
        B = filling_batch(H, Lq, device)
    if "wide" in spec:
        Lq = 130
        B = filling_batch(H, Lq, device, SM80_WIDE_BLOCK_M)
    if "decode" in spec:
        Lq, Lk = 1, 2053
    if "pack" in spec:
        H, Hkv, Lq, Lk = 16, 2, 5, 2053
    alignment = 1 if "bottom_right" in spec else 0
    q = torch.randn(B, H, Lq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(B, Hkv, Lk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(B, Hkv, Lk, dv, dtype=dtype, device=device, requires_grad=True)
    masks = masks_for(spec, B, Lq, Lk, dtype, device)
    out = attn_export.attention(q, k, v, is_causal=causal, causal_alignment=alignment, **masks)
    with deterministic_algorithms("deterministic" in spec):
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    results = {"out": out, **dict(zip(("dq", "dk", "dv"), grads))}
    mask, padding = masks.get("attn_mask"), masks.get("key_padding_mask")
    with torch.no_grad():
        _, lse, weights = ops._attention_forward(q, k, v, mask, padding, causal, None, True,
                                                 causal_alignment=alignment)
        grads = ops._attention_backward(torch.randn_like(out), torch.randn_like(weights), q, k, v, lse, mask, padding,
                                        causal, None, causal_alignment=alignment)
    results.update(weights=weights, **dict(zip(("dq(weights)", "dk(weights)", "dv(weights)"), grads)))
    if layer:
        # The in-projection is a cuBLAS GEMM: initcheck does not see its writes (gpu_check.sh).
        module = attn_export.FusedMultiheadAttention(H * dv, H, batch_first=True, device=device, dtype=dtype)
        x = torch.randn(B, Lq, H * dv, dtype=dtype, device=device, requires_grad=True)
        y, w = module(x, x, x, need_weights=True, average_attn_weights=False)
        (y.float().sum() + w.float().sum()).backward()
        results.update({"layer out": y, "layer weights": w, "layer dx": x.grad})
    if device == "cuda":
        torch.cuda.synchronize()
    return [name for name, t in results.items() if not t.isfinite().all()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a few cases, every kernel family (for the slower tools)")
    parser.add_argument("--no-layer", dest="layer", action="store_false",
                        help="leave out the layer, whose cuBLAS projections initcheck cannot follow")
    args = parser.parse_args(argv)
    failures = 0
    for case in QUICK if args.quick else CASES:
        dtype, d, dv, causal, spec = case
        label = f"{str(dtype).replace('torch.', '')} d={d} dv={dv} causal={causal} masks={spec or '-'}"
        bad = run_case(*case, device=args.device, layer=args.layer)
        print(f"{'ok' if not bad else 'NON-FINITE ' + ','.join(bad)}: {label}", flush=True)
        failures += bool(bad)
    print(f"{len(QUICK if args.quick else CASES) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
