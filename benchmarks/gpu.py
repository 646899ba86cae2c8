#!/usr/bin/env python
"""GPU benchmark of the fused attention: attn_export vs nn.MultiheadAttention vs
F.scaled_dot_product_attention, side by side in one process (scripts/gpu_check.sh runs it).

1. Latency of the whole layer at the seed's small shapes (batch 8, seq 10/16, embed 64/128,
   4 heads), float32 and float16: inference (eval + inference_mode: nn.MultiheadAttention takes
   PyTorch's native fast path), forward (training mode) and forward+backward.
2. Throughput of the attention core at seq 1k-8k, head dims 64 and 128, float16, causal and
   not, forward and forward+backward, in TFLOP/s (16k tokens per batch, 2048 / head_dim heads):
   attn_export.attention vs F.scaled_dot_product_attention vs the unfused math that
   nn.MultiheadAttention runs when it returns weights (softmax(Q K^T) V with the L x L matrix).
   FLOPs counted as FlashAttention does: 4 B H L^2 D forward (halved when causal),
   2.5x that for the backward.

Timing: torch.utils.benchmark (it synchronizes the device around each block of runs),
medians of blocked_autorange; implementations interleaved per configuration.

    python -m benchmarks.gpu --out gpu_check_out [--budget-s 150] [--quick]
    python -m benchmarks.gpu --dry-run     # tiny sizes on the CPU: checks the script itself
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.benchmark import Timer

import attn_export
from benchmarks.layers import SHAPE_SETS, layer_statement

LAYER_IMPLS = ("fused", "nn.MultiheadAttention", "sdpa")
CORE_IMPLS = ("fused", "sdpa", "unfused")
DEVICE = "cuda"

def median_s(fn, min_run_time):
    fn()  # warm-up (allocations, lazy init, autotuning)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median

# ---- 1. layer latency at small shapes -------------------------------------------------------

def bench_layers(args, deadline):
    rows = []
    for dtype in (torch.float32, torch.float16):
        for shape in SHAPE_SETS["small"]:
            for mode in ("inference", "forward", "forward+backward"):
                if time.monotonic() > deadline:
                    rows.append(dict(part="layer", shape=str(shape), dtype=str(dtype), mode=mode, skipped="time budget"))
                    continue
                times = {impl: median_s(layer_statement(impl, mode, shape, DEVICE, dtype), args.min_run_time)
                         for impl in LAYER_IMPLS}
                ref = times["nn.MultiheadAttention"]
                row = dict(part="layer", shape=str(shape), dtype=str(dtype).replace("torch.", ""), mode=mode,
                           **{f"{i}_us": t * 1e6 for i, t in times.items()},
                           **{f"{i}_vs_mha": t / ref for i, t in times.items() if i != "nn.MultiheadAttention"})
                rows.append(row)
                print(f"layer {row['shape']:>10} {row['dtype']:>8} {mode:>16}: "
                      + "  ".join(f"{i} {t * 1e6:8.1f} us" for i, t in times.items()), flush=True)
    return rows

# ---- 2. core TFLOP/s at long sequences -----------------------------------------------------

def core_fn(impl, q, k, v, causal):
    if impl == "fused":
        return lambda: attn_export.attention(q, k, v, is_causal=causal)
    if impl == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    L = q.shape[2]
    mask = torch.ones(L, L, dtype=torch.bool, device=DEVICE).triu(1) if causal else None
    scale = q.shape[-1] ** -0.5

    def unfused():
        s = (q @ k.transpose(-1, -2)) * scale
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    return unfused

def bench_core(args, deadline):
    rows = []
    seqlens = [64, 128] if args.dry_run else [1024, 2048] if args.quick else [1024, 2048, 4096, 8192]
    for head_dim in (64, 128):
        for causal in (False, True):
            for seqlen in seqlens:
                tokens, embed = (256, 256) if args.dry_run else (16384, 2048)
                batch, heads = max(1, tokens // seqlen), embed // head_dim
                flops_fwd = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
                for mode, flops in (("forward", flops_fwd), ("forward+backward", 3.5 * flops_fwd)):
                    row = dict(part="core", dtype="float16", seqlen=seqlen, head_dim=head_dim, batch=batch,
                               heads=heads, causal=causal, mode=mode)
                    if time.monotonic() > deadline:
                        row["skipped"] = "time budget"
                        rows.append(row)
                        continue
                    torch.manual_seed(0)
                    q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device=DEVICE, dtype=torch.float16,
                                           requires_grad=mode != "forward") for _ in range(3))
                    for impl in CORE_IMPLS:
                        try:
                            fn = core_fn(impl, q, k, v, causal)
                            if mode == "forward":
                                with torch.no_grad():
                                    t = median_s(fn, args.min_run_time)
                            else:
                                grad = torch.randn(batch, heads, seqlen, head_dim, device=DEVICE, dtype=torch.float16)
                                t = median_s(lambda fn=fn, grad=grad: torch.autograd.grad(fn(), (q, k, v), grad), args.min_run_time)
                            row[f"{impl}_ms"] = t * 1e3
                            row[f"{impl}_tflops"] = flops / t / 1e12
                        except torch.OutOfMemoryError:
                            row[f"{impl}_ms"] = row[f"{impl}_tflops"] = None
                            row[f"{impl}_note"] = "out of memory"
                        if DEVICE == "cuda":
                            torch.cuda.empty_cache()
                    rows.append(row)
                    print(f"core D={head_dim} causal={causal!s:5} L={seqlen:5} {mode:>16}: "
                          + "  ".join(f"{i} {row.get(f'{i}_tflops') or 0:6.1f} TFLOP/s" for i in CORE_IMPLS), flush=True)
    return rows

def environment():
    if DEVICE != "cuda":
        return dict(device="cpu (dry run)", torch=torch.__version__)

    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as e:  # noqa: BLE001
            return f"unavailable ({e})"

    return dict(
        gpu=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
        torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(),
        attn_export=attn_export.__version__, commit=run(["git", "rev-parse", "--short", "HEAD"]),
        driver=run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
    )

def markdown(env, rows):
    out = ["# GPU benchmark", "", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    out += ["## Layer latency (median, microseconds; ratio to nn.MultiheadAttention)", "",
            "| shape (BxLxExH) | dtype | mode | fused | nn.MultiheadAttention | sdpa | fused / MHA | sdpa / MHA |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "layer" and "skipped" not in r:
            out.append(f"| {r['shape']} | {r['dtype']} | {r['mode']} | {r['fused_us']:.1f} | {r['nn.MultiheadAttention_us']:.1f} "
                       f"| {r['sdpa_us']:.1f} | {r['fused_vs_mha']:.2f}x | {r['sdpa_vs_mha']:.2f}x |")
    out += ["", "## Attention core throughput (float16, TFLOP/s; FLOPs as FlashAttention counts them)", "",
            "| head dim | causal | seq | batch x heads | mode | fused | sdpa | unfused (L x L) |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "OOM" if x is None else f"{x:.1f}"  # noqa: E731
    for r in rows:
        if r["part"] == "core" and "skipped" not in r:
            out.append(f"| {r['head_dim']} | {r['causal']} | {r['seqlen']} | {r['batch']}x{r['heads']} | {r['mode']} | "
                       + " | ".join(fmt(r.get(f"{i}_tflops")) for i in CORE_IMPLS) + " |")
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        out += ["", f"{len(skipped)} configurations skipped (time budget)."]
    return "\n".join(out) + "\n"

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("gpu_check_out"))
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop starting new configurations after this")
    parser.add_argument("--min-run-time", type=float, default=0.1, help="seconds per blocked_autorange")
    parser.add_argument("--quick", action="store_true", help="seq 1k and 2k only")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, to check the script")
    args = parser.parse_args()
    global DEVICE
    if args.dry_run:
        DEVICE, args.min_run_time = "cpu", 0.01
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.gpu needs a GPU (or --dry-run)")
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    env = environment()
    print("environment:", env, flush=True)
    rows = bench_layers(args, time.monotonic() + args.budget_s * 0.3) + bench_core(args, deadline)
    (args.out / "bench_gpu.json").write_text(json.dumps(dict(environment=env, results=rows), indent=2))
    (args.out / "bench_gpu.md").write_text(markdown(env, rows))
    print(f"wrote {args.out / 'bench_gpu.md'} and bench_gpu.json")

if __name__ == "__main__":
    main()
