"""The benchmarks' command line: the fused layer against nn.MultiheadAttention (and SDPA) on
the CPU; with --gemm, --core or --onnx the other benchmarks of docs/benchmarks.md.

    python -m benchmarks.run --shapes small --mode forward
    python -m benchmarks.run --core --markdown benchmarks/results/core.md
"""
from __future__ import annotations

import dataclasses
import json

import click

from attn_export.cli._common import fail

MODE_CHOICES = ("forward", "forward+backward", "inference")


@click.command()
@click.option("--shapes", "shape_set", default="all", show_default=True,
              help="Comma-separated presets (small, decode, large, all) and/or BATCHxSEQxEMBEDxHEADS, e.g. small,1x512x512x8.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(MODE_CHOICES),
              help="Repeatable. Default: all three (training forward, forward+backward, inference).")
@click.option("--no-sdpa", is_flag=True, help="Skip the F.scaled_dot_product_attention baseline.")
@click.option("--threads", type=int, default=2, show_default=True, help="torch.set_num_threads for the run.")
@click.option("--rounds", type=int, default=10, show_default=True,
              help="Interleaved rounds per measurement; the minimum of the per-round medians is kept.")
@click.option("--min-run-time", type=float, default=0.05, show_default=True,
              help="Seconds per blocked_autorange in each round.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), help="Write the table as Markdown.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="Write a PNG of latency against sequence length (needs matplotlib); "
                   "meant for --shapes sweep.")
@click.option("--memory", "memory_shape", metavar="BxLxExH",
              help="Also measure the peak resident memory of one inference call at this shape, "
                   "each implementation in a fresh process (e.g. 1x8192x256x8; with --onnx: comma-separated BxL, "
                   "e.g. 1x2048,8x4096).")
@click.option("--onnx", "onnx_mode", is_flag=True,
              help="Instead: a 4-layer nn.TransformerEncoder with a key-padding mask in ONNX Runtime (torch.onnx's "
                   "export, --onnx-attention custom and standard) against PyTorch eager (docs/benchmarks.md).")
@click.option("--seqs", default="64,512,2048,4096", show_default=True, help="With --onnx: sequence lengths.")
@click.option("--batches", default="1,8", show_default=True, help="With --onnx: batch sizes.")
@click.option("--gemm", "gemm_rates", is_flag=True,
              help="Also the GEMM-rate line: GFLOP/s of the shapes' projection GEMMs under each GEMM backend "
                   "against ONNX Runtime's MatMul on the same shapes (benchmarks/gemm.py).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, metavar="N",
              help="With --onnx: leave out the shapes with batch x seq > N (a reduced run).")
@click.option("--profile", "profile_shape", metavar="BxL",
              help="With --onnx: also what ONNX Runtime runs at this shape: node counts of its optimized graphs "
                   "and kernel time per op type from its profiler (per node the fastest of 10 calls: robust to load).")
@click.option("--core", "core_mode", is_flag=True,
              help="Instead: the attention core alone, [1, 4, L, 64], against ONNX Runtime's com.microsoft."
                   "MultiHeadAttention and SDPA (forward), and SDPA (forward+backward) (benchmarks/core.py).")
def bench(shape_set, modes, no_sdpa, threads, rounds, min_run_time, json_path, markdown_path, plot_path,
          memory_shape, onnx_mode, seqs, batches, gemm_rates, max_tokens, profile_shape,
          core_mode):
    """Time the fused layer against PyTorch's attention, side by side in one process.

    Reports, per implementation, the minimum over interleaved rounds of torch.utils.benchmark
    medians (noise on shared machines only ever inflates a measurement), and the ratio
    time(impl) / time(nn.MultiheadAttention); below 1.00x is faster. Inference compares against nn.MultiheadAttention in eval mode under
    torch.inference_mode, i.e. PyTorch's native fused fast path.
    """
    import torch
    from rich.console import Console

    from benchmarks import layers as lib

    if core_mode:
        return _bench_core(threads, rounds, min_run_time, json_path, markdown_path)
    if onnx_mode:
        return _bench_onnx(seqs, batches, max_tokens, threads, rounds, min_run_time, memory_shape, json_path,
                           markdown_path, plot_path, profile_shape)

    shapes, memory = _layer_options(shape_set, rounds, min_run_time, threads, memory_shape)
    torch.set_num_threads(threads)
    impls = [i for i in lib.IMPLEMENTATIONS if not (no_sdpa and i == "sdpa")]
    console = Console(stderr=True)
    header = _machine_header()
    click.echo(header)
    with console.status("benchmarking") as status:
        results = lib.run_benchmark(
            shapes, modes or MODE_CHOICES, impls, rounds=rounds, min_run_time=min_run_time,
            progress=lambda what: status.update(f"benchmarking {what}"),
        )

    Console(width=max(Console().width, 100)).print(_results_table(results, impls, threads))
    gemm_results = _gemm_rates(console, shapes, threads, rounds, min_run_time) if gemm_rates else []
    memory_results = _peak_memory(console, memory, impls, threads) if memory is not None else []
    _write_layer_results(header, threads, rounds, results, gemm_results, memory_results, json_path, markdown_path,
                         plot_path)


def _layer_options(shape_set: str, rounds: int, min_run_time: float, threads: int, memory_shape):
    """The shapes to time (presets and BxLxExH) and the --memory shape (or None), after checking
    the options."""
    from benchmarks import layers as lib

    shapes = []
    for part in shape_set.split(","):
        try:
            shapes += lib.SHAPE_SETS[part] if part in lib.SHAPE_SETS else [lib.Shape.parse(part)]
        except ValueError as exc:
            fail(str(exc))
    if rounds < 1 or min_run_time <= 0 or threads < 1:
        fail("--rounds and --threads must be >= 1 and --min-run-time > 0")
    try:
        memory = lib.Shape.parse(memory_shape) if memory_shape else None
    except ValueError as exc:
        fail(f"--memory: {exc}")
    return shapes, memory


def _gemm_rates(console, shapes, threads: int, rounds: int, min_run_time: float):
    """--gemm: the projection GEMMs' rates under each GEMM backend, printed; the results."""
    from benchmarks import gemm as bench_gemm

    with console.status("GEMM rates") as status:
        gemm_results = bench_gemm.run_gemm_rates(
            bench_gemm.projection_gemms(shapes), rounds=rounds, min_run_time=min_run_time,
            progress=lambda what: status.update(f"GEMM rates: {what}"))
    click.echo(f"GEMM rate (projections, {threads} threads; ratio = GFLOP/s / {bench_gemm.ORT}'s):")
    click.echo(bench_gemm.markdown_table(gemm_results))
    return gemm_results


def _peak_memory(console, memory, impls, threads: int):
    """--memory: each implementation's peak memory at that shape, printed; the results."""
    from rich.console import Console

    from benchmarks import layers as lib

    short = {lib.REFERENCE: "nn.MHA"}
    with console.status(f"measuring peak memory at {memory}"):
        memory_results = lib.measure_memory(memory, impls, threads)
    Console().print(_memory_table(memory_results, memory, short))
    return memory_results


def _write_layer_results(header: str, threads: int, rounds: int, results, gemm_results, memory_results,
                         json_path, markdown_path, plot_path) -> None:
    """--json, --markdown and --plot, each written whole or not at all."""
    import torch

    from benchmarks import layers as lib
    from attn_export.atomic_io import write_text

    if json_path:
        payload = {"machine": header, "threads": threads, "torch": torch.__version__, "rounds": rounds,
                   "results": [r.as_dict() for r in results],
                   "gemm_rates": [r.as_dict() for r in gemm_results],
                   "memory": [m.as_dict() for m in memory_results]}
        write_text(json_path, json.dumps(payload, indent=2) + "\n")
    if markdown_path:
        text = header + "\n\n" + lib.markdown_table(results) + "\n"
        if gemm_results:
            from benchmarks import gemm as bench_gemm

            text += "\n" + bench_gemm.markdown_table(gemm_results) + "\n"
        if memory_results:
            text += "\n" + lib.memory_markdown_table(memory_results) + "\n"
        write_text(markdown_path, text)
    if plot_path:
        from attn_export.atomic_io import atomic_output

        with atomic_output(plot_path) as tmp:
            lib.plot_latency(results, str(tmp), fmt="png")


def _results_table(results, impls, threads: int):
    import torch
    from rich.table import Table

    from benchmarks import layers as lib

    table = Table(title=f"CPU, {threads} threads, torch {torch.__version__}: median us (ratio to {lib.REFERENCE})")
    short = {lib.REFERENCE: "nn.MHA"}
    for col in ("shape BxLxExH", "mode", *impls):
        table.add_column(short.get(col, col), justify="right" if col in impls else "left", no_wrap=True)
    for shape, mode in dict.fromkeys((r.shape, r.mode) for r in results):
        row = {r.implementation: r for r in results if r.shape == shape and r.mode == mode}
        cells = [f"{row[i].median_us:.1f}" + (f" ({row[i].ratio:.2f}x)" if row[i].ratio is not None else "") for i in impls]
        table.add_row(str(shape), mode, *cells)
    return table


def _memory_table(memory_results, memory, short):
    from rich.table import Table

    table = Table(title=f"Peak resident memory, one inference call at {memory} (fresh process each)")
    for col in ("implementation", "baseline MB", "peak MB", "peak / nn.MHA"):
        table.add_column(col, justify="right")
    for m in memory_results:
        table.add_row(short.get(m.implementation, m.implementation), f"{m.baseline_mb:.0f}",
                      f"{m.peak_mb:.0f}", "" if m.ratio is None else f"{m.ratio:.2f}x")
    return table


def _machine_header() -> str:
    """The CPU, its ISA and the GEMM library the layer runs on: the ratios depend on all three."""
    from attn_export.ops import gemm as _gemm
    from benchmarks.onnx_runtime import machine

    facts = machine()
    choice = _gemm.gemm_backend()
    kernels = f" + {choice.microkernel} micro-kernels" if choice.microkernel else ""
    config = _gemm.openblas_config() if choice.name == "openblas" else ""
    return (f"CPU: {facts['cpu']} ({facts['isa']}); torch {facts['torch']} BLAS {facts['torch_gemm']}\n"
            f"GEMM backend: {choice.name}{kernels}{' [' + config + ']' if config else ''} - {choice.reason}")


def _bench_core(threads, rounds, min_run_time, json_path, markdown_path):
    """--core (benchmarks/core.py)."""
    from rich.console import Console

    from benchmarks import core as lib
    from attn_export.atomic_io import write_text

    if rounds < 1 or min_run_time <= 0 or threads < 1:
        fail("--rounds and --threads must be >= 1 and --min-run-time > 0")
    click.echo("machine: " + ", ".join(f"{k} {v}" for k, v in lib.facts(threads).items()))
    check = lib.parity()
    click.echo("parity (max |attn_export - impl|, L = 256): " + ", ".join(f"{k} {v:.1e}" for k, v in check.items()))
    with Console(stderr=True).status("benchmarking") as status:
        status.update("measuring the FMA peak")
        peak = lib.fma_peak_gflops(threads)
        results = lib.run_benchmark(threads=threads, rounds=rounds, min_run_time=min_run_time, peak=peak,
                                    progress=lambda what: status.update(f"benchmarking: {what}"))
    click.echo(f"float32 FMA peak of {threads} thread(s), {lib.core_isa()} vectors: "
               + (f"{peak:.1f} GFLOP/s" if peak > 0 else "not measured (generic kernels)"))
    table = lib.markdown_table(results)
    click.echo(table)
    if markdown_path:
        write_text(markdown_path, table + "\n")
    if json_path:
        write_text(json_path, json.dumps(lib.as_json(results, threads, rounds, check, peak), indent=2) + "\n")


def _sizes(text: str, option: str):
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        fail(f"{option} {text}: comma-separated positive integers, e.g. 64,512")
    return sizes


def _onnx_shapes(text: str, option: str):
    """BATCHxSEQ[,BATCHxSEQ...] -> [(batch, seq), ...]."""
    try:
        shapes = [tuple(int(x) for x in part.lower().split("x")) for part in text.split(",")]
        assert shapes and all(len(shape) == 2 and min(shape) > 0 for shape in shapes)
    except (ValueError, AssertionError):
        fail(f"{option} {text}: with --onnx it is BATCHxSEQ (comma-separated), e.g. 1x2048,8x4096")
    return shapes


def _bench_onnx(seqs, batches, max_tokens, threads, rounds, min_run_time, memory_shape, json_path, markdown_path,
                plot_path, profile_shape=None):
    """--onnx (benchmarks/onnx_runtime.py)."""
    import tempfile
    from pathlib import Path

    from rich.console import Console

    from benchmarks import onnx_runtime as lib
    from attn_export.atomic_io import atomic_output, write_text

    seqs, batches = _sizes(seqs, "--seqs"), _sizes(batches, "--batches")
    memory = _onnx_shapes(memory_shape, "--memory") if memory_shape else []
    (profile,) = _onnx_shapes(profile_shape, "--profile")[:1] if profile_shape else (None,)
    if rounds < 1 or min_run_time <= 0 or threads < 1:
        fail("--rounds and --threads must be >= 1 and --min-run-time > 0")
    console = Console(stderr=True)
    facts = lib.machine()
    click.echo("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    with tempfile.TemporaryDirectory() as tmp, console.status("benchmarking") as status:
        results, run_facts = lib.run_benchmark(seqs, batches, threads=threads, rounds=rounds,
                                               min_run_time=min_run_time, max_tokens=max_tokens, directory=Path(tmp),
                                               progress=lambda what: status.update(f"benchmarking: {what}"))
        files = {k: Path(v) for k, v in run_facts.pop("onnx_files").items()}
        memory_results = {}
        for batch, seq in memory:
            status.update(f"peak memory at batch {batch}, sequence {seq}")
            memory_results[f"{batch}x{seq}"] = lib.measure_memory(batch, seq, files, threads)
        profile_result = {}
        if profile:
            status.update(f"profiling ONNX Runtime at batch {profile[0]}, sequence {profile[1]}")
            profile_result = lib.graph_profile(files, *profile, threads)
    table = lib.markdown_table(results)
    click.echo(table)
    for key, value in run_facts.items():
        click.echo(f"{key}: {value}")
    extra = [lib.memory_markdown_table(shape, memory_results[f"{shape[0]}x{shape[1]}"]) for shape in memory]
    if profile_result:
        extra.append(lib.profile_markdown(profile, profile_result))
    for text in extra:
        click.echo(text)
    if markdown_path:
        write_text(markdown_path, "\n\n".join([table] + extra) + "\n")
    if json_path:
        payload = {"machine": facts, "threads": threads, "rounds": rounds, **run_facts,
                   "results": [dataclasses.asdict(r) for r in results], "memory": memory_results,
                   "profile": {"shape": f"{profile[0]}x{profile[1]}", **profile_result} if profile else {}}
        write_text(json_path, json.dumps(payload, indent=2) + "\n")
    if plot_path:
        with atomic_output(plot_path) as tmp_png:
            lib.plot(results, str(tmp_png))


if __name__ == "__main__":
    bench(prog_name="python -m benchmarks.run")
