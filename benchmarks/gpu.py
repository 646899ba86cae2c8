#!/usr/bin/env python
"""GPU benchmark of the fused attention against every backend of F.scaled_dot_product_attention
(flash, cuDNN, efficient, and math where its L x L scores are cheap), each pinned with
torch.nn.attention.sdpa_kernel, in one process; scripts/gpu_check.sh runs it. Issue 46's table:

  prefill  head dims 32/64/128, seq 1k-16k, causal and not, fp16 and bf16, forward and
           forward+backward, in TFLOP/s (16k tokens per batch, 2048 / head dim heads)
  hdims    head dims 80/96/256, bf16 causal seq 4096
  decode   1 and 4 queries against a 4k and a 32k KV cache, head dim 128, B16 H32, Hkv 32 and 8
           (GQA), bf16, in GB/s of K and V read, against the GPU's HBM peak
  padded   key_padding_mask with lengths 25-100% of 4096, fp16 head dim 64
  layer    the layer at (B, L, E, H) = (4, 4096, 1024, 8) bf16 against nn.MultiheadAttention
  small    the layer at the seed's small shapes (launch-bound; not in the default set)

FLOPs as FlashAttention counts them (benchmarks/gpu_cases.py); times by CUDA events, best of N
blocks after warm-up (benchmarks/gpu_timing.py); a backend that refuses a case is "n/a" with its
reason. Writes bench_gpu.json and bench_gpu.md under --out.

    python -m benchmarks.gpu --out gpu_check_out [--budget-s 420] [--quick] [--cases decode,hdims]
    python -m benchmarks.gpu --estimate            # the plan and its time, without running
    python -m benchmarks.gpu --dry-run             # tiny sizes on the CPU: checks the script itself
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time

from benchmarks.gpu_cases import DEFAULT_GROUPS, GROUPS, dry_run_case, select_cases


def parse_groups(text: str):
    groups = [g.strip() for g in text.split(",") if g.strip()]
    unknown = [g for g in groups if g not in GROUPS]
    if unknown or not groups:
        raise argparse.ArgumentTypeError(f"unknown case group(s) {unknown or text!r}: pick from {', '.join(GROUPS)}")
    return groups


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu_check_out"))
    parser.add_argument("--cases", type=parse_groups, default=list(DEFAULT_GROUPS),
                        help=f"comma-separated groups, run in this order (default {','.join(DEFAULT_GROUPS)})")
    parser.add_argument("--quick", action="store_true",
                        help="fewer rows (prefill seq 1k and 8k, hdims forward, decode one query) and 3 blocks")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip the cases whose estimated time no longer fits in this many seconds")
    parser.add_argument("--blocks", type=int, default=None, help="best of this many blocks (default 5, --quick 3)")
    parser.add_argument("--hbm-peak-tbs", type=float, default=None,
                        help="HBM peak in TB/s for the decode rows (default: from the GPU's name)")
    parser.add_argument("--estimate", action="store_true", help="print the plan and its estimated time, run nothing")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, to check the script")
    return parser.parse_args(argv)


def timing_for(args):
    from benchmarks.gpu_timing import Timing
    blocks = args.blocks or (3 if args.quick else 5)
    if args.dry_run:
        return Timing(blocks=2, block_s=0.002, max_s=0.05, warmup=1)
    return Timing(blocks=blocks)


def plan(args):
    """(cases, timing, estimated seconds per case)."""
    from benchmarks.gpu_impls import impls_for
    from benchmarks.gpu_plan import case_s
    cases = select_cases(args.cases, args.quick)
    if args.dry_run:
        cases = [dry_run_case(c) for c in cases]
    timing = timing_for(args)
    return cases, timing, [case_s(c, impls_for(c), timing) for c in cases]


def print_plan(cases, estimates, budget_s):
    for group in dict.fromkeys(c.group for c in cases):
        sel = [e for c, e in zip(cases, estimates) if c.group == group]
        print(f"  {group:8} {len(sel):4d} cases  ~{sum(sel):6.0f} s")
    total = sum(estimates)
    print(f"estimated run time ~{total:.0f} s for {len(cases)} cases (budget {budget_s:.0f} s"
          + (": the cases that no longer fit are skipped)" if total > budget_s else ")"), flush=True)


def environment(device: str) -> dict:
    import torch
    import attn_export
    env = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
               attn_export=attn_export.__version__, commit=_run(["git", "rev-parse", "--short", "HEAD"]),
               # the paths not yet verified on a GPU run only with it (docs/cuda.md "Preview")
               ATTN_EXPORT_CUDA_PREVIEW=os.environ.get("ATTN_EXPORT_CUDA_PREVIEW", ""),
               # with the preview, on Hopper, the sm_90a forward (docs/cuda.md "Hopper forward")
               ATTN_EXPORT_CUDA_SM90=os.environ.get("ATTN_EXPORT_CUDA_SM90", ""))
    if device != "cuda":
        return dict(device="cpu (dry run)", **env)
    return dict(gpu=torch.cuda.get_device_name(0),
                capability=".".join(map(str, torch.cuda.get_device_capability(0))), **env,
                driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))


def _run(cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({e})"


def run_cases(cases, estimates, timing, device, budget_s, peak_tbs):
    """Every case that still fits the budget: (rows, skipped cases)."""
    from benchmarks.gpu_impls import impls_for
    from benchmarks.gpu_report import summarize
    from benchmarks.gpu_timing import measure
    deadline = time.monotonic() + budget_s
    rows, skipped = [], []
    for case, estimate in zip(cases, estimates):
        if time.monotonic() + estimate > deadline:
            skipped.append(case)
            continue
        row = summarize(case, {impl: measure(impl, case, device, timing) for impl in impls_for(case)}, peak_tbs)
        rows.append(row)
        print(f"{row['label']:58} " + "  ".join(f"{i} {_fmt(c['value'])}" for i, c in row["columns"].items())
              + f"  [{row['metric']}]", flush=True)
    return rows, skipped


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main(argv=None):
    args = parse_args(argv)
    command = "python -m benchmarks.gpu " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    cases, timing, estimates = plan(args)
    print_plan(cases, estimates, args.budget_s)
    if args.estimate:
        return
    import torch
    from benchmarks.gpu_report import hbm_peak_tbs, markdown
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks.gpu needs a GPU (or --dry-run, or --estimate)")
    env = environment(device)
    print("environment:", env, flush=True)
    peak = args.hbm_peak_tbs or (hbm_peak_tbs(env["gpu"]) if device == "cuda" else None)
    rows, skipped = run_cases(cases, estimates, timing, device, args.budget_s, peak)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gpu.json").write_text(json.dumps(
        dict(environment=env, command=command, results=rows, skipped=[c.label() for c in skipped]), indent=2))
    (args.out / "bench_gpu.md").write_text(markdown(env, command, rows, skipped))
    print(f"wrote {args.out / 'bench_gpu.md'} and bench_gpu.json ({len(rows)} rows, {len(skipped)} skipped)")


if __name__ == "__main__":
    main()
