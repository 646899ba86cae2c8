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
    """Every group end to end at tiny sizes on the CPU: each row measured by attn_export, the
    backends the CPU lacks "n/a" with a reason, the tables written."""
    ran = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out", str(tmp_path),
                          "--cases", "decode,hdims,padded,layer,prefill,small", "--quick"], cwd=ROOT,
                         check=True, capture_output=True, text=True, timeout=600)
    lines = ran.stdout.splitlines()
    estimate = next(i for i, line in enumerate(lines) if line.startswith("estimated run time"))
    assert estimate < next(i for i, line in enumerate(lines) if line.startswith("environment:"))  # before it runs
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    results = data["results"]
    assert {r["group"] for r in results} == {"decode", "hdims", "padded", "layer", "prefill", "small"}
    assert not data["skipped"] and data["command"].startswith("python -m benchmarks.gpu --dry-run")
    assert all(r["columns"]["attn_export"]["value"] is not None for r in results)
    attention = [r for r in results if r["group"] not in ("layer", "small")]
    assert all(set(r["columns"]) == {"attn_export", "flash", "cudnn", "efficient", "math"} for r in attention)
    assert all(r["columns"]["cudnn"]["note"].startswith("n/a: ") for r in attention)  # no cuDNN on the CPU
    assert all(r["best"] is not None and r["ours_vs_best"] > 0 for r in attention)
    table = (tmp_path / "bench_gpu.md").read_text()
    assert "nn.MultiheadAttention" in table and "TFLOP/s" in table and "GB/s of K and V read" in table


def test_bench_gpu_help():
    ran = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 0 and "--cases" in ran.stdout and "--estimate" in ran.stdout, ran.stderr


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


FAKE_SANITIZER = r"""#!/bin/bash
# compute-sanitizer as seen on an H200, per tool: clean; a hazard in cuBLAS's kernel only; a report
# in one of ours; the program failing under the tool.
case $2 in
  memcheck) echo "========= ERROR SUMMARY: 0 errors"; exit 0 ;;
  racecheck) echo "========= Error: Race reported between Read access at nvjet_sm90_tst+0xb00"
             echo "=========     and Write access at nvjet_sm90_tst+0x2820 [480 hazards]"; exit 9 ;;
  initcheck) echo "========= Uninitialized __global__ memory read of size 16 bytes"
             echo "=========     at void attn_export::cuda::device::flash_fwd_kernel<T>(P)+0xb10"
             echo "=========         Host Frame: attn_export::cuda::run_flash_fwd_ at launch"; exit 9 ;;
  synccheck) echo "========= Target application returned an error"; exit 9 ;;
esac
"""


def test_gpu_check_counts_only_reports_in_attn_exports_kernels(tmp_path):
    """gpu_check.sh's sanitizer step, with a stand-in compute-sanitizer: a report that names
    another library's kernel passes, one that names ours or a program that failed does not."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    step = script[script.index("sanitize_step() {"):]
    step = step[:step.index("\n}\n") + 3]
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    driver = f"""summary() {{ echo "$*"; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY=true; STATUS=0; CUDA_HOME=/nonexistent
{step}
sanitize_step; echo "STATUS=$STATUS"
"""
    ran = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}, timeout=60)
    lines = ran.stdout.splitlines()
    assert lines == [
        "PASSED sanitizer: memcheck, no report",
        "PASSED sanitizer: racecheck, no report in attn_export's kernels (others' kernels reported: see sanitize.log)",
        "FAILED sanitizer: initcheck exit 9, 1 reports in attn_export's kernels (see sanitize.log)",
        "FAILED sanitizer: synccheck exit 9, 0 reports in attn_export's kernels, the program failed (see sanitize.log)",
        "STATUS=4",
    ], ran.stdout + ran.stderr
    log = (tmp_path / "sanitize.log").read_text()
    assert "== racecheck: exit 9, reports naming attn_export's kernels: 0" in log and "nvjet_sm90_tst" in log


def run_bench_step(tmp_path, extra_env):
    """gpu_check.sh's benchmark step with a stand-in python that records its arguments."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    step = script[script.index("bench_step() {"):]
    step = step[:step.index("\n}\n") + 3]
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$@" > "$(dirname "$0")/args"\necho "wrote it (9 rows, 0 skipped)"\n')
    fake.chmod(0o755)
    driver = f"""summary() {{ echo "$*"; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY={fake}; STATUS=0; START=$SECONDS
{step}
bench_step; echo "STATUS=$STATUS"
"""
    ran = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", **extra_env}, timeout=60)
    return ran.stdout.splitlines(), (tmp_path / "args").read_text().split()


def test_gpu_check_runs_the_benchmark_within_its_budget(tmp_path):
    lines, args = run_bench_step(tmp_path, {"GPU_CHECK_BUDGET_S": "540"})
    assert args[:2] == ["-m", "benchmarks.gpu"] and args[-1] == "--quick"  # the default: every group, fewer rows
    budget = int(args[args.index("--budget-s") + 1])
    assert 480 <= budget <= 500  # 540 less the margin (and the second or so this step took to start)
    assert lines[0].startswith("PASSED benchmark in") and lines[0].endswith("(9 rows, 0 skipped)")
    assert lines[-1] == "STATUS=0"
    _, args = run_bench_step(tmp_path, {"GPU_CHECK_BUDGET_S": "540", "GPU_BENCH_ARGS": ""})
    assert "--quick" not in args  # set but empty: the full default set
    _, args = run_bench_step(tmp_path, {"GPU_BENCH_ARGS": "--cases decode,hdims"})
    assert args[-2:] == ["--cases", "decode,hdims"]


def test_gpu_check_measures_and_sanitizes_the_preview_paths(tmp_path):
    """The benchmark and the sanitizer run with ATTN_EXPORT_CUDA_PREVIEW=1 unless CHECK_PREVIEW=0,
    and the test step runs tests/ops/test_cuda.py once more with it (docs/cuda.md "Preview")."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    step = script[script.index("bench_step() {"):]
    step = step[:step.index("\n}\n") + 3]
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "preview=$ATTN_EXPORT_CUDA_PREVIEW" > "$(dirname "$0")/env"\necho done\n')
    fake.chmod(0o755)
    for check, want in (({}, "preview=1"), ({"CHECK_PREVIEW": "0"}, "preview=0")):
        driver = f"""summary() {{ echo "$*"; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY={fake}; STATUS=0; START=$SECONDS
{step}
bench_step
"""
        subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT,
                       env={"PATH": "/usr/bin:/bin", **check}, timeout=60)
        assert (tmp_path / "env").read_text().strip() == want
    sanitize = script[script.index("sanitize_step() {"):]
    assert "ATTN_EXPORT_CUDA_PREVIEW=${CHECK_PREVIEW:-1}" in sanitize[:sanitize.index("\n}\n")]
    preview = script[script.index("preview_tests() {"):]
    assert "ATTN_EXPORT_CUDA_PREVIEW=1 timeout" in preview and "tests/ops/test_cuda.py" in preview
    assert "  preview_tests\n}" in script[script.index("tests_step() {"):]
