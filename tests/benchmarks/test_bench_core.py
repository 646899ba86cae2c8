"""benchmarks.run --core: the share of the machine's FMA peak that each row reports.

The rate is the algorithm's floating-point operations over the core's median time, against the
float32 multiply-add ceiling that benchmarks/csrc/fma_peak.cpp measures on the same threads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from benchmarks import core as bench_core
from benchmarks.run import bench

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("onnxruntime")  # bench_core's machine facts name ONNX Runtime's version


def _visible_pairs(seq: int, causal: bool) -> int:
    return sum(1 for i in range(seq) for j in range(seq) if not causal or j <= i)


@pytest.mark.parametrize("seq", [1, 5, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_are_two_per_multiply_add_of_the_products_over_the_visible_pairs(seq, causal):
    per_product = 2 * bench_core.BATCH * bench_core.HEADS * bench_core.HEAD_DIM * _visible_pairs(seq, causal)
    assert bench_core.core_flops("forward", seq, causal) == 2 * per_product
    assert bench_core.core_flops("forward+backward", seq, causal) == 7 * per_product


def test_a_row_reports_the_cores_rate_and_its_share_of_the_peak():
    medians = {bench_core.CORE: 2.0, bench_core.SDPA: 4.0}
    row = bench_core._result("forward", 512, False, medians, peak=100.0)
    rate = 4 * 4 * 512 * 512 * 64 / 2e-3 / 1e9  # [1, 4, 512, 64], two products, in 2 ms
    assert row.core_gflops == pytest.approx(rate)
    assert row.of_peak == pytest.approx(rate / 100.0)
    assert row.ratios == {f"{bench_core.CORE} / {bench_core.SDPA}": 0.5}
    unmeasured = bench_core._result("forward", 512, False, medians, peak=0.0)
    assert unmeasured.of_peak is None
    table = bench_core.markdown_table([row, unmeasured])
    assert "| of FMA peak |" in table.splitlines()[0]
    assert f"| {rate:.1f} | {rate / 100.0:.0%} |" in table
    assert table.splitlines()[-1].endswith("| not measured |")


def test_the_peak_is_measured_in_the_vector_width_of_the_cores_kernels():
    isa = bench_core.core_isa()
    peak = bench_core.fma_peak_gflops(1, seconds=0.05)
    if isa == "generic":
        assert peak == 0.0
        return
    # Above zero and below what any x86 core can do: two FMA units of 16 lanes at 6 GHz.
    assert 0.0 < peak < 2 * 16 * 2 * 6.0
    # The generic kernels have no fused multiply-add: nothing is measured, never a made-up rate.
    code = "from benchmarks import core as bench_core; print(bench_core.fma_peak_gflops(1, seconds=0.05))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "ATTN_EXPORT_CPU_ISA": "generic"}, check=True)
    assert float(out.stdout.split()[-1]) == 0.0


def test_bench_core_prints_the_peak_and_writes_it_to_the_json(tmp_path, monkeypatch):
    # The timing loop itself is replaced: this checks what the command reports, not speed.
    medians = {bench_core.CORE: 2.0, bench_core.SDPA: 4.0}
    monkeypatch.setattr(bench_core, "parity", lambda: {bench_core.SDPA: 0.0})
    monkeypatch.setattr(bench_core, "fma_peak_gflops", lambda threads: 100.0)
    monkeypatch.setattr(bench_core, "run_benchmark",
                        lambda **kw: [bench_core._result("forward", 512, False, medians, kw["peak"])])
    report = tmp_path / "core.json"
    result = CliRunner().invoke(bench, ["--core", "--threads", "1", "--json", str(report)])
    assert result.exit_code == 0, result.output
    assert "float32 FMA peak of 1 thread(s)" in result.output and "100.0 GFLOP/s" in result.output
    data = json.loads(report.read_text())
    assert data["fma_peak_gflops"] == 100.0
    assert data["results"][0]["of_peak"] == pytest.approx(data["results"][0]["core_gflops"] / 100.0)
