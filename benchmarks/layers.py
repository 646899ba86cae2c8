"""Side-by-side CPU benchmark of the fused layer against PyTorch's attention.

Every implementation is timed with torch.utils.benchmark in the same process, interleaved in
many short rounds. Shared machines slow down in bursts (windows of 30-100x have been seen)
that inflate whichever measurement they hit and never deflate one, so each implementation's
time is the minimum over rounds of its per-round median, and the ratio to
nn.MultiheadAttention is taken between those minima.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.benchmark import Timer

from attn_export.ops.module import FusedMultiheadAttention
from benchmarks import child_env

MODES = ("forward", "forward+backward", "inference")
REFERENCE = "nn.MultiheadAttention"
IMPLEMENTATIONS = ("fused", REFERENCE, "sdpa")


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seqlen: int
    embed: int
    heads: int

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """'8x16x128x4' -> batch 8, seq 16, embed 128, heads 4."""
        try:
            batch, seqlen, embed, heads = (int(p) for p in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {text!r} is not BATCHxSEQxEMBEDxHEADS, e.g. 8x16x128x4") from None
        if min(batch, seqlen, embed, heads) <= 0 or embed % heads:
            raise ValueError(f"shape {text!r}: sizes must be positive and EMBED divisible by HEADS")
        return cls(batch, seqlen, embed, heads)

    def __str__(self) -> str:
        return f"{self.batch}x{self.seqlen}x{self.embed}x{self.heads}"


SHAPE_SETS = {
    "small": [Shape(8, 10, 64, 4), Shape(8, 10, 128, 4), Shape(8, 16, 64, 4), Shape(8, 16, 128, 4)],
    "decode": [Shape(8, 1, 256, 8)],
    "large": [Shape(8, 256, 256, 4), Shape(1, 512, 512, 8)],
}
SHAPE_SETS["all"] = SHAPE_SETS["small"] + SHAPE_SETS["decode"] + SHAPE_SETS["large"]
# Latency against sequence length (the --plot chart): batch 1, embed 256, 8 heads.
SHAPE_SETS["sweep"] = [Shape(1, seqlen, 256, 8) for seqlen in (16, 32, 64, 128, 256, 512, 1024, 2048)]


class SDPAAttention(nn.Module):
    """The layer written the usual way in Python: projections + F.scaled_dot_product_attention."""

    def __init__(self, ref: nn.MultiheadAttention):
        super().__init__()
        self.ref = ref

    def forward(self, x):
        ref = self.ref
        batch, seqlen, embed = x.shape
        qkv = F.linear(x, ref.in_proj_weight, ref.in_proj_bias)
        q, k, v = qkv.view(batch, seqlen, 3, ref.num_heads, embed // ref.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return F.linear(out.transpose(1, 2).reshape(batch, seqlen, embed), ref.out_proj.weight, ref.out_proj.bias)


@dataclasses.dataclass
class Result:
    shape: Shape
    mode: str
    implementation: str
    median_us: float  # minimum over rounds of the per-round median
    ratio: Optional[float]  # median_us / median_us(nn.MultiheadAttention)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = str(self.shape)
        return d


def make_layer(impl: str, shape: Shape, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(layer, input) for one implementation; all share the weights of one seeded layer."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(shape.embed, shape.heads, batch_first=True, device=device, dtype=dtype)
    layer = {"fused": lambda: FusedMultiheadAttention.from_module(ref), REFERENCE: lambda: ref,
             "sdpa": lambda: SDPAAttention(ref)}[impl]()
    return layer, torch.randn(shape.batch, shape.seqlen, shape.embed, device=device, dtype=dtype)


def call_layer(impl: str, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if impl == "sdpa":
        return layer(x)
    return layer(x, x, x, need_weights=False)[0]


def layer_statement(impl: str, mode: str, shape: Shape, device: str = "cpu",
                    dtype: torch.dtype = torch.float32) -> Callable[[], object]:
    """What one timed call runs: the layer in ``mode`` (inference: eval + inference_mode, where
    nn.MultiheadAttention takes PyTorch's native fast path; forward: training mode;
    forward+backward: gradients of the input and every parameter)."""
    layer, x = make_layer(impl, shape, device, dtype)

    def call(inp):
        return call_layer(impl, layer, inp)

    if mode == "inference":
        layer.eval()  # nn.MultiheadAttention then takes PyTorch's native fused fast path

        def run():
            with torch.inference_mode():
                return call(x)

        return run
    layer.train()
    x.requires_grad_(True)
    if mode == "forward":
        return lambda: call(x)
    grad = torch.randn_like(x)

    def run_backward():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        call(x).backward(grad)

    return run_backward


def run_benchmark(
    shapes: Iterable[Shape],
    modes: Iterable[str] = MODES,
    implementations: Iterable[str] = IMPLEMENTATIONS,
    rounds: int = 10,
    min_run_time: float = 0.05,
    progress: Optional[Callable[[str], None]] = None,
) -> List[Result]:
    implementations = list(implementations)
    if REFERENCE not in implementations:
        implementations.append(REFERENCE)
    results = []
    for shape in shapes:
        for mode in modes:
            if progress:
                progress(f"{shape} {mode}")
            stmts = {impl: layer_statement(impl, mode, shape) for impl in implementations}
            for stmt in stmts.values():
                stmt()  # warm-up: first-call allocations and lazy initialization
            medians: Dict[str, List[float]] = {impl: [] for impl in implementations}
            for _ in range(rounds):
                for impl, stmt in stmts.items():
                    timer = Timer(stmt="stmt()", globals={"stmt": stmt}, num_threads=torch.get_num_threads())
                    medians[impl].append(timer.blocked_autorange(min_run_time=min_run_time).median)
            best = {impl: min(times) for impl, times in medians.items()}
            for impl in implementations:
                results.append(Result(
                    shape, mode, impl, best[impl] * 1e6,
                    None if impl == REFERENCE else best[impl] / best[REFERENCE],
                ))
    return results


@dataclasses.dataclass
class MemoryResult:
    shape: Shape
    implementation: str
    baseline_mb: float
    peak_mb: float
    ratio: Optional[float]  # peak / peak(nn.MultiheadAttention)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = str(self.shape)
        return d


def measure_memory(shape: Shape, implementations: Iterable[str], threads: int) -> List[MemoryResult]:
    """Peak resident memory of one inference call per implementation, each in a fresh process."""
    import json
    import subprocess
    import sys

    peaks = {}
    for impl in implementations:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory_probe", impl, str(shape), str(threads)],
            capture_output=True, text=True, check=True, env=child_env(),
        )
        peaks[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    ref_peak = peaks.get(REFERENCE, {}).get("peak_mb")
    return [
        MemoryResult(shape, impl, p["baseline_mb"], p["peak_mb"],
                     None if impl == REFERENCE or ref_peak is None else p["peak_mb"] / ref_peak)
        for impl, p in peaks.items()
    ]


def markdown_table(results: List[Result]) -> str:
    impls = list(dict.fromkeys(r.implementation for r in results))
    header = "| shape (BxLxExH) | mode | " + " | ".join(f"{i} (us)" for i in impls) + " | " + " | ".join(
        f"{i} / {REFERENCE}" for i in impls if i != REFERENCE) + " |"
    lines = [header, "|" + "---|" * (2 + len(impls) + len(impls) - 1)]
    keys = list(dict.fromkeys((r.shape, r.mode) for r in results))
    for shape, mode in keys:
        row = {r.implementation: r for r in results if r.shape == shape and r.mode == mode}
        times = " | ".join(f"{row[i].median_us:.1f}" for i in impls)
        ratios = " | ".join(f"{row[i].ratio:.2f}x" for i in impls if i != REFERENCE)
        lines.append(f"| {shape} | {mode} | {times} | {ratios} |")
    return "\n".join(lines)


def memory_markdown_table(results: List[MemoryResult]) -> str:
    lines = ["| shape (BxLxExH) | implementation | baseline MB | peak MB | peak / nn.MultiheadAttention |",
             "|---|---|---|---|---|"]
    for m in results:
        ratio = "" if m.ratio is None else f"{m.ratio:.2f}x"
        lines.append(f"| {m.shape} | {m.implementation} | {m.baseline_mb:.0f} | {m.peak_mb:.0f} | {ratio} |")
    return "\n".join(lines)


def plot_latency(results: List[Result], path: str, fmt: Optional[str] = None) -> None:
    """Latency against sequence length, one panel per mode (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in results))
    geometry = sorted({(r.shape.batch, r.shape.embed, r.shape.heads) for r in results})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for batch, embed, heads in geometry:
            for impl in dict.fromkeys(r.implementation for r in results):
                points = sorted(
                    (r.shape.seqlen, r.median_us) for r in results
                    if r.mode == mode and r.implementation == impl
                    and (r.shape.batch, r.shape.embed, r.shape.heads) == (batch, embed, heads)
                )
                label = impl if len(geometry) == 1 else f"{impl} (B{batch} E{embed} H{heads})"
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("median latency (us)")
        ax.set_title(mode)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=fmt)
    plt.close(fig)

