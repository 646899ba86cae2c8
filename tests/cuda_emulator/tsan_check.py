"""Runs a few representative kernel launches under ThreadSanitizer: a data race between
emulated threads is a missing __syncthreads() (or a cp.async refill of a buffer other warps
still read). Heavier than the unit tests (hundreds of threads per launch), so not part of the
suite; run by hand after touching synchronization in csrc/kernels/cuda:

    ATTN_EXPORT_EMU_TSAN=1 python tests/cuda_emulator/tsan_check.py --build
    for policy in late both; do
      ATTN_EXPORT_EMU_TSAN=1 ATTN_EXPORT_EMU_CP_ASYNC=$policy \\
        LD_PRELOAD=$(gcc -print-file-name=libtsan.so) python tests/cuda_emulator/tsan_check.py
    done

(The build step runs without LD_PRELOAD: a sanitizer preloaded into the compiler breaks it.)
Exit status 66 and "WARNING: ThreadSanitizer" reports mean a race.
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cuda_emulator.build import load  # noqa: E402

if "--build" in sys.argv:
    try:
        load()
    except OSError:  # built, but a TSan library cannot be loaded without LD_PRELOAD
        pass
    sys.exit(0)

emu = load()
torch.manual_seed(0)
CASES = [
    # dtype, B, H, Lq, Lk, head dim, causal, masks
    (torch.float16, 1, 1, 70, 130, 64, False, {}),
    (torch.bfloat16, 1, 1, 70, 70, 128, True, {}),
    (torch.float16, 1, 1, 40, 150, 32, True, {"key_padding_mask": torch.arange(150)[None] > 120}),
    (torch.float16, 2, 1, 33, 47, 64, False, {"attn_mask": torch.randn(33, 47)}),
    (torch.float32, 1, 1, 9, 11, 40, True, {"attn_mask": torch.rand(9, 11) < 0.3}),
]
for dtype, B, H, Lq, Lk, D, causal, masks in CASES:
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype) for n in (Lq, Lk, Lk))
    am, kpm = masks.get("attn_mask"), masks.get("key_padding_mask")
    out, lse, w = emu.forward(q, k, v, am, kpm, causal, None, dtype == torch.float32)
    gw = torch.randn(B, H, Lq, Lk) if dtype == torch.float32 else None
    grads = emu.backward(torch.randn_like(out), gw, q, k, v, lse, am, kpm, causal, None)
    finite = all(torch.isfinite(t).all() for t in (out, *grads))
    print(f"{dtype} B={B} H={H} Lq={Lq} Lk={Lk} D={D} causal={causal} masks={list(masks)}: "
          f"{'finite' if finite else 'NON-FINITE'}", flush=True)
