"""The exported model where users run it: ONNX Runtime (CPU) against PyTorch eager, side by side
in one process (``python -m benchmarks.run --onnx``; docs/benchmarks.md).

The model is a 4-layer ``nn.TransformerEncoder`` (embed 256, 4 heads, feed-forward 1024, batch
first) called with a key-padding mask (the last eighth of every row's keys padded). Timed, per
(batch, sequence):

* ``torch (original)`` and ``torch (fused)``: eager, eval, ``torch.inference_mode`` (the
  original takes PyTorch's native fast path);
* ``ort torch.onnx``: ONNX Runtime on ``torch.onnx.export(..., dynamo=True)`` of the untouched
  model (its default opset) -- the bar;
* ``ort custom`` / ``ort standard``: ONNX Runtime on ``attn_export.export_onnx`` with
  ``attention="custom"`` / ``"standard"``.

Each ONNX file is exported once with dynamic batch and sequence and serves every shape. Every
round times every implementation once (interleaved, so a burst of load on a shared machine hits
all of them alike; the order rotates from round to round, and no implementation's threads keep
spinning while another one is timed); an implementation's time is the median over rounds of its
per-round median.
Peak memory: one call per implementation in a fresh process (the peak never goes down), at each
``--memory`` shape. ``--profile``: what ONNX Runtime runs (:func:`graph_profile`), the view that a
loaded machine does not distort.
Also recorded: whether ONNX Runtime runs torch.onnx's opset-23 export of the same model (it emits
the standard Attention operator with a ``[B, 1, 1, Lk]`` mask).
"""
from __future__ import annotations

import dataclasses
import json
import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

EMBED, HEADS, LAYERS, FEEDFORWARD = 256, 4, 4, 1024
SEQS = (64, 512, 2048, 4096)
BATCHES = (1, 8)
TORCH_IMPLS = ("torch (original)", "torch (fused)")
ONNX_IMPLS = ("ort torch.onnx", "ort custom", "ort standard")
IMPLEMENTATIONS = TORCH_IMPLS + ONNX_IMPLS
REFERENCE = "ort torch.onnx"
# A pause before each timed block: PyTorch's OpenMP workers spin-wait for a while after a
# parallel region (ONNX Runtime's no longer do, see _session_options) and would otherwise run
# into the first calls of the next implementation.
SETTLE_S = 0.05


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder with named inputs (they become the ONNX input names)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(EMBED, HEADS, FEEDFORWARD, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    def forward(self, src, src_key_padding_mask):
        return self.encoder(src, src_key_padding_mask=src_key_padding_mask)


def build_model(seed: int = 0) -> PaddedEncoder:
    torch.manual_seed(seed)
    return PaddedEncoder().eval()


def make_inputs(batch: int, seq: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask[:, seq - max(1, seq // 8):] = True  # the last eighth of every row is padding
    return {"src": torch.randn(batch, seq, EMBED, generator=generator), "src_key_padding_mask": mask}


def export_all(model: nn.Module, directory: Path, progress: Callable[[str], None] = lambda _m: None) -> Dict[str, Path]:
    """The three ONNX files of the benchmark (dynamic batch and sequence), plus torch.onnx's
    opset-23 export (``torch.onnx opset 23``), in ``directory``."""
    from torch.export import Dim

    from attn_export.onnx import export_onnx

    example = make_inputs(2, 16)
    paths = {name: directory / f"{name.replace(' ', '_').replace('.', '_')}.onnx"
             for name in (*ONNX_IMPLS, "torch.onnx opset 23")}
    dynamic = {name: {0: Dim.AUTO, 1: Dim.AUTO} for name in example}
    for name, opset in ((REFERENCE, None), ("torch.onnx opset 23", 23)):
        progress(f"exporting {name}")
        program = torch.onnx.export(model, (), kwargs=example, dynamo=True, dynamic_shapes=dynamic,
                                    opset_version=opset, verbose=False, optimize=True)
        program.save(str(paths[name]))
    for flavor in ("custom", "standard"):
        progress(f"exporting ort {flavor}")
        export_onnx(model, example, paths[f"ort {flavor}"], attention=flavor)
    return paths


def _session_options(threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # One process holds a session per implementation, each with its own intra-op pool. By default
    # a pool's workers keep spin-waiting for work after a run returns (tens of ms), so the session
    # timed just before would burn a core while the next one is timed (on 2 cores the
    # standard flavor, timed right after the custom one, paid for the custom one's spinning).
    # Workers still spin between the nodes of a run; they stop when the run returns.
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return options


def onnx_session(path: Path, threads: int):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), _session_options(threads), providers=["CPUExecutionProvider"])


def _runner(impl: str, model: nn.Module, fused: nn.Module, sessions: Dict[str, object],
            inputs: Dict[str, torch.Tensor]) -> Callable[[], object]:
    if impl in TORCH_IMPLS:
        module = model if impl == TORCH_IMPLS[0] else fused

        def run_torch():
            with torch.inference_mode():
                return module(**inputs)

        return run_torch
    session = sessions[impl]
    feeds = {i.name: inputs[i.name].numpy() for i in session.get_inputs()}
    return lambda: session.run(None, feeds)


@dataclasses.dataclass
class OnnxResult:
    batch: int
    seq: int
    implementation: str
    median_ms: float  # median over rounds of the per-round median
    ratio: Optional[float]  # median_ms / median_ms(ort torch.onnx)


def run_benchmark(seqs=SEQS, batches=BATCHES, *, threads: int = 2, rounds: int = 5, min_run_time: float = 0.2,
                  max_tokens: Optional[int] = None, directory: Path,
                  progress: Callable[[str], None] = lambda _m: None) -> tuple[List[OnnxResult], Dict[str, object]]:
    """(timings, facts): facts say whether ONNX Runtime runs torch.onnx's opset-23 export, and
    which shapes ``max_tokens`` (batch * seq) left out."""
    from attn_export.surgery.replace import replace_attention
    import copy

    torch.set_num_threads(threads)
    model = build_model()
    fused = copy.deepcopy(model)
    replace_attention(fused)
    paths = export_all(model, directory, progress)
    sessions = {impl: onnx_session(paths[impl], threads) for impl in ONNX_IMPLS}
    facts = {"onnx_files": {k: str(v) for k, v in paths.items()}, "skipped_shapes": []}
    try:
        small = {k: v.numpy() for k, v in make_inputs(2, 16).items()}
        onnx_session(paths["torch.onnx opset 23"], threads).run(None, small)
        facts["torch.onnx opset 23 in onnxruntime"] = "runs"
    except Exception as exc:  # noqa: BLE001 - the point: it fails
        facts["torch.onnx opset 23 in onnxruntime"] = "fails: " + str(exc).splitlines()[0][-160:]
    results = []
    for batch in batches:
        for seq in seqs:
            if max_tokens is not None and batch * seq > max_tokens:
                facts["skipped_shapes"].append(f"{batch}x{seq}")
                continue
            progress(f"batch {batch}, sequence {seq}")
            inputs = make_inputs(batch, seq)
            runners = {impl: _runner(impl, model, fused, sessions, inputs) for impl in IMPLEMENTATIONS}
            per_round = interleaved_rounds(runners, rounds, min_run_time)
            medians = {impl: statistics.median(times) for impl, times in per_round.items()}
            results += [OnnxResult(batch, seq, impl, medians[impl] * 1e3,
                                   None if impl == REFERENCE else medians[impl] / medians[REFERENCE])
                        for impl in IMPLEMENTATIONS]
    return results, facts


def timing_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """An argument parser (its description the first paragraph of ``doc``) with the options
    every timing script takes: ``--threads`` (the same on every side) and ``--rounds``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads, the same for every side")
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (medians over them)")
    return parser


def paired_ratio(ours: List[float], peer: List[float], resamples: int = 2000) -> dict:
    """The median over rounds of ours / peer within each round (both timed in it, under the same
    load), with a 95% bootstrap interval of that median: what a difference of a few percent needs,
    where the load drifts between rounds by more than that."""
    import numpy as np

    ratios = np.asarray(ours) / np.asarray(peer)
    draws = np.random.default_rng(0).choice(ratios, (resamples, len(ratios)))
    low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return {"ratio": float(np.median(ratios)), "ratio_ci95": [float(low), float(high)]}


def round_order(impls, index: int) -> List[str]:
    """The order of round ``index``: rotated by one each round, so that over as many rounds as
    implementations each one is timed at every position (first after PyTorch, last, ...) and
    whatever one block leaves behind (warm or evicted caches, threads still busy) does not always
    fall on the same neighbour. Never one implementation twice in a row across rounds (its second
    block would find the caches it warmed): two alternate in a fixed order."""
    impls = list(impls)
    shift = index % len(impls) if len(impls) > 2 else 0
    return impls[shift:] + impls[:shift]


def interleaved_rounds(runners: Dict[str, Callable[[], object]], rounds: int, min_run_time: float,
                       settle_s: float = SETTLE_S) -> Dict[str, List[float]]:
    """Each runner's median call time (seconds) per round, after one warm-up call each: the
    runners take turns within a round, in :func:`round_order`, a pause before each block."""
    for run in runners.values():
        run()  # warm-up
    per_round: Dict[str, List[float]] = {impl: [] for impl in runners}
    for index in range(rounds):
        for impl in round_order(runners, index):
            time.sleep(settle_s)
            per_round[impl].append(_median_call(runners[impl], min_run_time))
    return per_round


def _median_call(run: Callable[[], object], min_run_time: float) -> float:
    """Median seconds of one call, over as many calls as fit in ``min_run_time`` (at least 3)."""
    times = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_run_time:
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_profile(paths: Dict[str, Path], batch: int, seq: int, threads: int, runs: int = 10) -> Dict[str, dict]:
    """What ONNX Runtime actually runs, per ONNX implementation: the node count of its optimized
    graph by op type (which fusions fired: Gemm, FusedMatMul, SkipLayerNormalization, Attention,
    ...) and, at one shape, the kernel time per op type from ONNX Runtime's profiler, each node
    counted at its fastest of ``runs`` calls. Per-node minimums are far less disturbed by other
    load on the machine than wall-clock times, so this says where the time goes even on a busy
    machine. {impl: {"source_nodes", "optimized_nodes", "ops": {op: count}, "kernel_ms": {op: ms}}}."""
    import collections
    import os
    import tempfile

    import onnx
    import onnxruntime as ort

    out = {}
    feeds = {k: v.numpy() for k, v in make_inputs(batch, seq).items()}
    with tempfile.TemporaryDirectory() as tmp:
        for impl in ONNX_IMPLS:
            options = _session_options(threads)
            options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
            options.enable_profiling = True
            options.profile_file_prefix = os.path.join(tmp, "profile")
            session = ort.InferenceSession(str(paths[impl]), options, providers=["CPUExecutionProvider"])
            for _ in range(runs):
                session.run(None, feeds)
            events = json.loads(Path(session.end_profiling()).read_text())
            optimized = onnx.load(options.optimized_model_filepath)
            fastest: Dict[str, float] = {}
            op_of: Dict[str, str] = {}
            for e in events:
                if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                    fastest[e["name"]] = min(fastest.get(e["name"], float("inf")), e["dur"])
                    op_of[e["name"]] = e["args"]["op_name"]
            kernel_ms: Dict[str, float] = collections.defaultdict(float)
            for name, us in fastest.items():
                kernel_ms[op_of[name]] += us / 1e3
            out[impl] = {"source_nodes": len(onnx.load(str(paths[impl])).graph.node),
                         "optimized_nodes": len(optimized.graph.node),
                         "ops": dict(collections.Counter(n.op_type for n in optimized.graph.node).most_common()),
                         "kernel_ms": dict(sorted(kernel_ms.items(), key=lambda kv: -kv[1]))}
    return out


def profile_markdown(shape, profile: Dict[str, dict]) -> str:
    """Two tables: the optimized graphs' node counts by op type, and kernel time per op type."""
    impls = list(profile)
    ops = list(dict.fromkeys(op for p in profile.values() for op in p["ops"]))
    lines = ["| nodes (ONNX Runtime's optimized graph) | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls),
             "| in the file | " + " | ".join(str(profile[i]["source_nodes"]) for i in impls) + " |",
             "| after optimization | " + " | ".join(str(profile[i]["optimized_nodes"]) for i in impls) + " |"]
    lines += [f"| {op} | " + " | ".join(str(profile[i]["ops"].get(op, 0)) for i in impls) + " |" for op in ops]
    kernel_ops = list(dict.fromkeys(op for p in profile.values() for op in p["kernel_ms"]))
    lines += ["", f"| kernel ms, batch {shape[0]} seq {shape[1]} (per node: fastest call) | "
              + " | ".join(impls) + " |", "|---|" + "---|" * len(impls),
              "| total | " + " | ".join(f"{sum(profile[i]['kernel_ms'].values()):.2f}" for i in impls) + " |"]
    lines += [f"| {op} | " + " | ".join(f"{profile[i]['kernel_ms'].get(op, 0.0):.2f}" for i in impls) + " |"
              for op in kernel_ops]
    return "\n".join(lines)


def measure_memory(batch: int, seq: int, paths: Dict[str, Path], threads: int) -> Dict[str, Dict[str, float]]:
    """Peak resident memory of one call per implementation, each in a fresh process:
    {impl: {"baseline_mb", "peak_mb"}} (baseline: model or session and inputs ready)."""
    import subprocess
    import sys

    from benchmarks import child_env

    out = {}
    for impl in IMPLEMENTATIONS:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.onnx_runtime", impl, f"{batch}x{seq}", str(threads),
             str(paths.get(impl, ""))], capture_output=True, text=True, check=True, env=child_env())
        out[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def memory_markdown_table(shape, memory: Dict[str, Dict[str, float]]) -> str:
    ref = memory.get(REFERENCE)
    lines = [f"| peak memory, batch {shape[0]} seq {shape[1]} | baseline MB | peak MB | peak - baseline MB | "
             f"(peak - baseline) / {REFERENCE} |", "|---|---|---|---|---|"]
    for impl, m in memory.items():
        work = m["peak_mb"] - m["baseline_mb"]
        ratio = f"{work / (ref['peak_mb'] - ref['baseline_mb']):.2f}x" if ref and ref["peak_mb"] > ref["baseline_mb"] else ""
        lines.append(f"| {impl} | {m['baseline_mb']:.0f} | {m['peak_mb']:.0f} | {work:.0f} | {ratio} |")
    return "\n".join(lines)


def machine() -> Dict[str, str]:
    """CPU model, the ISA extensions that decide GEMM speed, and the GEMM libraries."""
    import platform

    import onnxruntime

    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", platform.processor()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile") if f in flags]
    blas = next((part.split("=", 1)[1] for part in torch.__config__.show().replace(",", "\n").split()
                 if part.startswith("BLAS_INFO=")), "unknown")
    return {"cpu": model, "isa": " ".join(isa) or "unknown", "torch": torch.__version__,
            "torch_gemm": blas, "onnxruntime": onnxruntime.__version__, "onnxruntime_gemm": "MLAS"}


def markdown_table(results: List[OnnxResult]) -> str:
    impls = list(dict.fromkeys(r.implementation for r in results))
    lines = ["| batch | seq | " + " | ".join(f"{i} (ms)" for i in impls) + " | "
             + " | ".join(f"{i} / {REFERENCE}" for i in impls if i != REFERENCE) + " |",
             "|" + "---|" * (2 + 2 * len(impls) - 1)]
    for batch, seq in dict.fromkeys((r.batch, r.seq) for r in results):
        row = {r.implementation: r for r in results if (r.batch, r.seq) == (batch, seq)}
        lines.append(f"| {batch} | {seq} | " + " | ".join(f"{row[i].median_ms:.1f}" for i in impls) + " | "
                     + " | ".join(f"{row[i].ratio:.2f}x" for i in impls if i != REFERENCE) + " |")
    return "\n".join(lines)


def plot(results: List[OnnxResult], path: str) -> None:
    """Latency against sequence length, one panel per batch size (matplotlib, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch for r in results})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for impl in dict.fromkeys(r.implementation for r in results):
            points = sorted((r.seq, r.median_ms) for r in results if r.batch == batch and r.implementation == impl)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("median latency (ms)")
        ax.set_title(f"4-layer encoder, batch {batch}, key-padding mask")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def _probe() -> None:
    """python -m benchmarks.onnx_runtime IMPL BATCHxSEQ THREADS [ONNX]: prints JSON
    {"baseline_mb", "peak_mb"} of one call (see measure_memory)."""
    import sys

    impl, shape, threads, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else ""
    batch, seq = (int(x) for x in shape.split("x"))
    torch.set_num_threads(threads)
    inputs = make_inputs(batch, seq)
    if impl in TORCH_IMPLS:
        model = build_model()
        if impl == TORCH_IMPLS[1]:
            from attn_export.surgery.replace import replace_attention

            replace_attention(model)
        run = _runner(impl, model, model, {}, inputs)
    else:
        run = _runner(impl, None, None, {impl: onnx_session(Path(path), threads)}, inputs)
    baseline = _high_water_mb()
    run()
    print(json.dumps({"baseline_mb": baseline, "peak_mb": _high_water_mb()}))


def _high_water_mb() -> float:
    """This process's peak resident memory (VmHWM). Not ru_maxrss: Linux carries that across
    fork and exec, so a probe started by a big process would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


if __name__ == "__main__":
    _probe()
