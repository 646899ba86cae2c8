"""Runs a few representative kernel launches under ThreadSanitizer: a data race between
emulated threads is a missing __syncthreads() (or, with --order early, a cp.async refill of a
buffer other warps still read). Heavier than the unit tests (hundreds of threads per launch),
so not part of `make test`; `make tsan` runs it under both cp.async orderings:

    ATTN_EXPORT_EMU_TSAN=1 python tests/ops/cuda/cuda_emulator/tsan_check.py --build
    for order in late early; do
      ATTN_EXPORT_EMU_TSAN=1 LD_PRELOAD=$(gcc -print-file-name=libtsan.so) \\
        python tests/ops/cuda/cuda_emulator/tsan_check.py --order $order
    done

(The build step runs without LD_PRELOAD: a sanitizer preloaded into the compiler breaks it.)
Exit status 66 and "WARNING: ThreadSanitizer" reports mean a race; exit status 1 a wrong
(non-finite) result or an emulator failure.
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from cuda_emulator.build import load  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--build", action="store_true", help="only build the TSan extension")
parser.add_argument("--order", choices=["late", "early"], default="late", help="cp.async ordering")
args = parser.parse_args()

if args.build:
    try:
        load()
    except OSError:  # built, but a TSan library cannot be loaded without LD_PRELOAD
        pass
    sys.exit(0)

emu = load()
emu.set_cp_async_order(args.order)
torch.manual_seed(0)
CASES = [
    # arch, dtype, B, H, Lq, Lk, head dim, causal, masks
    (90, torch.float16, 1, 1, 70, 130, 64, False, {}),
    (80, torch.bfloat16, 1, 1, 70, 70, 128, True, {}),
    (90, torch.float16, 1, 1, 40, 150, 32, True, {"key_padding_mask": torch.arange(150)[None] > 120}),
    (80, torch.float16, 2, 1, 33, 47, 64, False, {"attn_mask": torch.randn(33, 47)}),
    (90, torch.float32, 1, 1, 9, 11, 40, True, {"attn_mask": torch.rand(9, 11) < 0.3}),
]
failed = False
for arch, dtype, B, H, Lq, Lk, D, causal, masks in CASES:
    emu.set_arch(arch)
    q, k, v = (torch.randn(B, H, n, D, dtype=dtype) for n in (Lq, Lk, Lk))
    am, kpm = masks.get("attn_mask"), masks.get("key_padding_mask")
    out, lse, w = emu.forward(q, k, v, am, kpm, causal, None, dtype == torch.float32)
    gw = torch.randn(B, H, Lq, Lk) if dtype == torch.float32 else None
    grads = emu.backward(torch.randn_like(out), gw, q, k, v, lse, am, kpm, causal, None)
    finite = all(torch.isfinite(t).all() for t in (out, *grads))
    failed |= not finite
    print(f"sm_{arch} {args.order} {dtype} B={B} H={H} Lq={Lq} Lk={Lk} D={D} causal={causal} masks={list(masks)}: "
          f"{'finite' if finite else 'NON-FINITE'}", flush=True)
sys.exit(1 if failed else 0)
