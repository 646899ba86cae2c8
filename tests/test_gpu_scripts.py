"""The GPU check's scripts work before they reach a GPU: the benchmark runs end to end on tiny
CPU sizes, gpu_check.sh parses, and the pytest-free runner finds every GPU test."""
import json
import pathlib
import subprocess
import sys
import pytest

pytestmark = pytest.mark.slow  # make test-fast leaves it out

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_bench_gpu_dry_run(tmp_path):
    subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, text=True, timeout=600)
    results = json.loads((tmp_path / "bench_gpu.json").read_text())["results"]
    assert {r["part"] for r in results} == {"layer", "core"}
    assert all("skipped" not in r for r in results)
    table = (tmp_path / "bench_gpu.md").read_text()
    assert "nn.MultiheadAttention" in table and "TFLOP/s" in table


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_runner_without_pytest_finds_every_gpu_test():
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                str(ROOT / "tests" / "ops" / "test_cuda.py")], capture_output=True, text=True, cwd=ROOT)
    count = sum(1 for line in collected.stdout.splitlines() if "::test_" in line)
    ran = subprocess.run([sys.executable, str(ROOT / "tests" / "run_without_pytest.py"), "ops/test_cuda"],
                         capture_output=True, text=True, cwd=ROOT)
    assert count > 0 and ran.stdout.count("test_cuda::test_") == count, ran.stdout[-2000:] + ran.stderr[-2000:]


def test_sanitizer_cases_run_on_the_cpu():
    """gpu_sanitize.py's cases (every kernel path on a GPU) run and come out finite here too."""
    for extra in ([], ["--quick"], ["--quick", "--no-layer"]):
        ran = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_sanitize.py"), "--device", "cpu", *extra],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
        assert " 0 failed" in ran.stdout and "NON-FINITE" not in ran.stdout
