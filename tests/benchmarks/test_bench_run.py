"""python -m benchmarks.run: the benchmarks' command line, run as a user runs it (from the
checkout's root, in a process of its own)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]


def run(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_in_process(*args):
    """The command in this process (click's runner): for the checks that stop before any timing,
    where a new interpreter's imports would be most of the test's time."""
    from click.testing import CliRunner

    from benchmarks.run import bench

    return CliRunner().invoke(bench, list(map(str, args)))


def test_bench_help():
    out = run_in_process("--help").stdout
    assert "--shapes" in out and "--onnx" in out


def test_bench_smoke_writes_json_and_markdown(tmp_path: Path):
    json_path, md_path = tmp_path / "b.json", tmp_path / "b.md"
    run("--shapes", "2x3x16x2", "--mode", "forward", "--rounds", "1", "--min-run-time", "0.01",
        "--json", str(json_path), "--markdown", str(md_path))
    payload = json.loads(json_path.read_text())
    impls = {r["implementation"] for r in payload["results"]}
    assert impls == {"fused", "nn.MultiheadAttention", "sdpa"}
    assert all(r["median_us"] > 0 for r in payload["results"])
    assert "2x3x16x2" in md_path.read_text()


@pytest.mark.parametrize("bad", ["8x16", "8x16x10x3", "axbxcxd"])
def test_bench_rejects_bad_shapes_with_exit_2(bad):
    result = run_in_process("--shapes", bad)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)
    assert "error:" in result.stderr and "Traceback" not in result.stderr


def test_bench_plot_and_memory(tmp_path: Path):
    pytest.importorskip("matplotlib", reason="--plot needs the bench extra: pip install 'attn-export[bench]'")
    png, json_path = tmp_path / "latency.png", tmp_path / "b.json"
    run("--shapes", "1x8x16x2,1x32x16x2", "--mode", "inference", "--rounds", "1",
        "--min-run-time", "0.01", "--no-sdpa", "--plot", str(png), "--memory", "1x64x16x2",
        "--json", str(json_path))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    memory = json.loads(json_path.read_text())["memory"]
    assert {m["implementation"] for m in memory} == {"fused", "nn.MultiheadAttention"}
    assert all(m["peak_mb"] >= m["baseline_mb"] > 0 for m in memory)


@pytest.mark.parametrize("option,value", [("--memory", "1x2048,8"), ("--profile", "1xL")])
def test_onnx_shape_options_are_checked_before_anything_runs(option, value):
    result = run_in_process("--onnx", option, value)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit) and "Traceback" not in result.stderr
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and option in line and value in line and "BATCHxSEQ" in line, line
