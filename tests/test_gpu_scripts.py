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
                                str(ROOT / "tests" / "ops" / "cuda" / "test_cuda.py")], capture_output=True, text=True, cwd=ROOT)
    count = sum(1 for line in collected.stdout.splitlines() if "::test_" in line)
    ran = subprocess.run([sys.executable, str(ROOT / "tests" / "run_without_pytest.py"), "ops/cuda/test_cuda"],
                         capture_output=True, text=True, cwd=ROOT)
    assert count > 0 and ran.stdout.count("test_cuda::test_") == count, ran.stdout[-2000:] + ran.stderr[-2000:]


# The quick selection is what a GPU session runs first; it and its variant without the layer, and
# every case (~1 min here), in make test-all.
@pytest.mark.parametrize("extra", [pytest.param([], id="every-case", marks=pytest.mark.exhaustive),
                                   pytest.param(["--quick"], id="quick"),
                                   pytest.param(["--quick", "--no-layer"], id="quick-no-layer",
                                                marks=pytest.mark.exhaustive)])
def test_sanitizer_cases_run_on_the_cpu(extra):
    """gpu_sanitize.py's cases (every kernel path on a GPU) run and come out finite here too."""
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
{_functions("capped")}
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


def run_step(tmp_path, functions: tuple[str, ...], call: str, fake_python: str, extra_env=None) -> list[str]:
    """gpu_check.sh's named shell `functions` run by the bash of `call`, with a stand-in python
    (`fake_python`: its script after the shebang line): the lines it printed."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n" + fake_python)
    fake.chmod(0o755)
    driver = f"""summary() {{ echo "$*"; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY={fake}; STATUS=0; START=$SECONDS
{_functions(*functions)}
{call}
"""
    ran = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", **(extra_env or {})}, timeout=60)
    return ran.stdout.splitlines()


# A stand-in python for the benchmark step that records its arguments.
RECORD_ARGS = 'echo "$@" > "$(dirname "$0")/args"\necho "wrote it (9 rows, 0 skipped)"\n'


def bench_args(tmp_path, extra_env) -> tuple[list[str], list[str]]:
    """The benchmark step's output lines and the arguments it passed to python."""
    lines = run_step(tmp_path, ("bench_step",), 'bench_step; echo "STATUS=$STATUS"', RECORD_ARGS, extra_env)
    return lines, (tmp_path / "args").read_text().split()


def test_gpu_check_runs_the_benchmark_within_its_budget(tmp_path):
    lines, args = bench_args(tmp_path, {"GPU_CHECK_BUDGET_S": "540"})
    assert args[:2] == ["-m", "benchmarks.gpu"] and args[-1] == "--quick"  # the default: every group, fewer rows
    budget = int(args[args.index("--budget-s") + 1])
    assert 480 <= budget <= 500  # 540 less the margin (and the second or so this step took to start)
    assert lines[0].startswith("PASSED benchmark in") and lines[0].endswith("(9 rows, 0 skipped)")
    assert lines[-1] == "STATUS=0"
    _, args = bench_args(tmp_path, {"GPU_CHECK_BUDGET_S": "540", "GPU_BENCH_ARGS": ""})
    assert "--quick" not in args  # set but empty: the full default set
    _, args = bench_args(tmp_path, {"GPU_BENCH_ARGS": "--cases decode,hdims"})
    assert args[-2:] == ["--cases", "decode,hdims"]


def test_gpu_check_measures_and_sanitizes_the_preview_paths(tmp_path):
    """The benchmark and the sanitizer run with ATTN_EXPORT_CUDA_PREVIEW=1 unless CHECK_PREVIEW=0,
    and the test step runs tests/ops/cuda/test_cuda.py once more with it (docs/cuda.md "Preview")."""
    for check, want in (({}, "preview=1"), ({"CHECK_PREVIEW": "0"}, "preview=0")):
        run_step(tmp_path, ("bench_step",), "bench_step",
                 'echo "preview=$ATTN_EXPORT_CUDA_PREVIEW" > "$(dirname "$0")/env"\necho done\n', check)
        assert (tmp_path / "env").read_text().strip() == want
    lines = run_step(tmp_path, ("preview_tests", "run_gpu_tests"), "preview_tests",
                     'echo "preview=$ATTN_EXPORT_CUDA_PREVIEW $*" >> "$(dirname "$0")/calls"\necho "1 passed"\n')
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-1].startswith("preview=1 -m pytest -m cuda tests/ops/cuda/test_cuda.py"), calls
    assert lines[-1].startswith("PASSED preview tests in") and lines[-1].endswith(": 1 passed"), lines
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    sanitize = script[script.index("sanitize_step() {"):]
    assert "ATTN_EXPORT_CUDA_PREVIEW=${CHECK_PREVIEW:-1}" in sanitize[:sanitize.index("\n}\n")]
    assert "  preview_tests\n}" in script[script.index("tests_step() {"):]


def _functions(*names: str) -> str:
    """The named shell functions of gpu_check.sh, as text to source."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    out = []
    for name in names:
        body = script[script.index(f"\n{name}() {{") + 1:]
        out.append(body[:body.index("\n}\n") + 3])
    return "\n".join(out)


STEP_HELPERS = ("capped", "fits")
QUICK_FUNCTIONS = (*STEP_HELPERS, "sm90_built", "sm90_smoke", "sm90_quick_tests", "headline_bench", "sm90quick_step")

# python as the quick step calls it: `-c` (import pytest), `-` with arguments (the headline
# benchmark's script), `-` alone (the smoke run), `-m pytest` (the quick tier). Each call is logged.
FAKE_PYTHON = r"""#!/bin/bash
echo "$*" >> "$(dirname "$0")/calls"
case "$1" in
  -c) exit 0 ;;
  -) if [ $# -gt 1 ]; then echo "headline: B4 H16 Lq4096 Lk4096 D128 bfloat16 forward: attn_export / cudnn = 0.50"
                          echo "8 rows, 0 skipped"; exit 0; fi
     exit ${FAKE_SMOKE_RC:-0} ;;
  -m) echo "${FAKE_PYTEST_LAST:-53 passed in 40.00s}"; exit ${FAKE_PYTEST_RC:-0} ;;
esac
"""


def run_quick_step(tmp_path, **env):
    """gpu_check.sh's sm90quick step with a stand-in python: (summary lines, python calls)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "calls").write_text("")
    (tmp_path / "summary.txt").write_text("")
    driver = f"""summary() {{ echo "$*" | tee -a {tmp_path}/summary.txt; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY={fake}; STATUS=0; START=$SECONDS
CASE_TIMEOUT="-o timeout=90 -o timeout_method=thread"
{_functions(*QUICK_FUNCTIONS)}
sm90quick_step; echo "STATUS=$STATUS"
"""
    ran = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "TORCH_CUDA_ARCH_LIST": "9.0a", **env}, timeout=60)
    lines = (tmp_path / "summary.txt").read_text().splitlines() + ran.stdout.splitlines()[-1:]
    return lines, (tmp_path / "calls").read_text().splitlines()


def test_quick_step_runs_smoke_quick_tier_and_headline_rows(tmp_path):
    lines, calls = run_quick_step(tmp_path)
    assert [c.split()[0] for c in calls] == ["-", "-c", "-m", "-"]  # smoke, pytest?, the tier, the benchmark
    tier = calls[2]
    assert '-m cuda and sm90_quick' in tier and "tests/ops/cuda/test_cuda_sm90.py tests/ops/cuda/test_cuda_sm90_bwd.py" in tier
    assert "-o timeout=90 -o timeout_method=thread" in tier and "--durations=15" in tier
    assert lines[0].startswith("PASSED sm90 quick tier in") and lines[0].endswith(": 53 passed in 40.00s")
    assert lines[1] == "headline: B4 H16 Lq4096 Lk4096 D128 bfloat16 forward: attn_export / cudnn = 0.50"
    assert lines[2].startswith("PASSED headline benchmark in") and lines[2].endswith(": 8 rows, 0 skipped")
    assert lines[-1] == "STATUS=0"


def test_quick_step_says_why_it_stops(tmp_path):
    lines, calls = run_quick_step(tmp_path, TORCH_CUDA_ARCH_LIST="9.0")
    assert calls == [] and lines[0].startswith("SKIPPED sm90quick: built for 9.0, not 9.0a")
    lines, calls = run_quick_step(tmp_path, FAKE_SMOKE_RC="124")
    assert len(calls) == 1 and lines[0].startswith("FAILED sm90 smoke (exit 124; 124: a kernel hung)")
    assert lines[-1] == "STATUS=2"
    lines, _ = run_quick_step(tmp_path, FAKE_PYTEST_LAST="53 skipped in 1.00s")  # nothing verified
    assert lines[0].startswith("FAILED sm90 quick tier: no case ran (53 skipped") and lines[-1] == "STATUS=2"
    lines, _ = run_quick_step(tmp_path, FAKE_PYTEST_RC="1", FAKE_PYTEST_LAST="1 failed, 52 passed")
    assert lines[0].startswith("FAILED sm90 quick tier (exit 1;") and lines[-1] == "STATUS=2"
    lines, calls = run_quick_step(tmp_path, GPU_CHECK_BUDGET_S="45")  # 35 s left: the smoke fits, nothing else
    assert [c.split()[0] for c in calls] == ["-"]
    assert lines[0].startswith("SKIPPED sm90 quick tier: 3") and lines[0].endswith("it needs ~60 s")
    assert lines[1].startswith("SKIPPED headline benchmark: 3") and lines[-1] == "STATUS=2"


def test_headline_benchmark_runs_on_the_cpu(tmp_path):
    """The headline rows' script itself, at dry-run sizes on the CPU: every row measured, both
    tables written, and no file beyond the 8 the device tool brings back."""
    driver = f"""summary() {{ echo "$*" | tee -a {tmp_path}/summary.txt; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY={sys.executable}; STATUS=0; START=$SECONDS
{_functions(*STEP_HELPERS, "headline_bench")}
headline_bench; echo "STATUS=$STATUS"
"""
    import os
    ran = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "HEADLINE_DRY_RUN": "1"})
    assert ran.stdout.splitlines()[-1] == "STATUS=0", ran.stdout[-3000:] + ran.stderr[-2000:]
    data = json.loads((tmp_path / "bench_headline.json").read_text())
    assert [r["group"] for r in data["results"]] == ["prefill"] * 4 + ["hdims"] * 2 + ["decode"] * 2
    assert all(r["columns"]["attn_export"]["value"] is not None for r in data["results"]) and not data["skipped"]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert sum(line.startswith("headline: ") for line in summary) == 8
    assert summary[-1].startswith("PASSED headline benchmark") and "TFLOP/s" in (tmp_path / "bench_headline.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench_headline.json", "bench_headline.md", "summary.txt"]


FAKE_BUILD_PYTHON = r"""#!/bin/bash
echo "$*" >> "$(dirname "$0")/calls"
case "$1 $2" in
  "-m pip") echo "[7/101] nvcc sm90_flash_fwd_hdim128_bf16.cu"; sleep "${FAKE_PIP_S:-0}" ;;
esac
exit 0
"""


def run_build_step(tmp_path, **env):
    """gpu_check.sh's build with a stand-in python (pip sleeps FAKE_PIP_S): (summary, calls, rc)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_BUILD_PYTHON)
    fake.chmod(0o755)
    for name in ("calls", "summary.txt"):
        (tmp_path / name).write_text("")
    driver = f"""summary() {{ echo "$*" | tee -a {tmp_path}/summary.txt; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY={fake}; ROOT={tmp_path}; START=$SECONDS; CAPABILITY=9.0a; MAX_JOBS=16
{_functions(*STEP_HELPERS, "build_loads", "source_stamp", "build_step", "build_timed_out")}
build_step
"""
    ran = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "TORCH_CUDA_ARCH_LIST": "9.0a", "BUILD_TIMEOUT_S": "480", **env})
    calls = [c.split()[1] if c.startswith("-m") else c.split()[0] for c in (tmp_path / "calls").read_text().splitlines()]
    return (tmp_path / "summary.txt").read_text().splitlines(), calls, ran.returncode


def test_build_fails_fast_on_a_timeout_and_is_reused_on_a_warm_machine(tmp_path):
    lines, calls, rc = run_build_step(tmp_path, BUILD_TIMEOUT_S="1", FAKE_PIP_S="5")
    assert rc == 1 and calls == ["pip"]  # not built again in place: that would take as long again
    assert lines == ["FAILED build: timed out after 1 s for sm_90a at MAX_JOBS=16 (compile steps done: [7/101]; "
                     "see build.log): raise BUILD_TIMEOUT_S and GPU_CHECK_BUDGET_S"]
    lines, calls, rc = run_build_step(tmp_path, GPU_CHECK_BUDGET_S="30")  # the budget cuts the timeout
    assert rc == 0 and calls == ["pip", "-c"] and lines[0].startswith("PASSED build for sm_90a in")
    lines, calls, rc = run_build_step(tmp_path)  # same sources, same architectures: reused
    assert rc == 0 and calls == ["-c"] and lines == ["PASSED build for sm_90a: reused this machine's earlier build of the same sources"]
    lines, calls, _ = run_build_step(tmp_path, TORCH_CUDA_ARCH_LIST="9.0")  # another architecture: built
    assert calls == ["pip", "-c"]
    _, calls, _ = run_build_step(tmp_path, TORCH_CUDA_ARCH_LIST="9.0", GPU_CHECK_REBUILD="1")
    assert calls == ["pip", "-c"]
    lines, calls, rc = run_build_step(tmp_path, GPU_CHECK_BUDGET_S="5", FAKE_PIP_S="5")  # spent: 1 s, not none
    assert rc == 1 and lines[0].startswith("FAILED build: timed out after 1 s") and calls == ["pip"]


def run_train_step(tmp_path, rc: int):
    """gpu_check.sh's train step with a stand-in python that exits `rc`: (summary lines, its call)."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\necho "$ATTN_EXPORT_CUDA_PREVIEW $*" > "$(dirname "$0")/call"\n'
                    'echo "training 3 x 200 steps"\necho "VERDICT: fused gap 1e-3, noise 1e-2"\nexit $FAKE_RC\n')
    fake.chmod(0o755)
    driver = f"""summary() {{ echo "$*" | tee -a {tmp_path}/summary.txt; }}; log() {{ :; }}
OUT_DIR={tmp_path}; PY={fake}; STATUS=0; START=$SECONDS
{_functions(*STEP_HELPERS, "train_step")}
train_step; echo "STATUS=$STATUS"
"""
    ran = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "FAKE_RC": str(rc)})
    lines = (tmp_path / "summary.txt").read_text().splitlines() + ran.stdout.splitlines()[-1:]
    return lines, (tmp_path / "call").read_text().strip()


def test_train_step_runs_the_curve_script_and_gates_on_it(tmp_path):
    (tmp_path / "pass").mkdir()
    lines, call = run_train_step(tmp_path / "pass", 0)
    assert call == f"1 scripts/train_curve.py --device cuda --out {tmp_path / 'pass'}/train_curve"
    assert lines[0].startswith("PASSED training curves in") and lines[0].endswith(": VERDICT: fused gap 1e-3, noise 1e-2")
    assert lines[-1] == "STATUS=0" and not (tmp_path / "pass" / "train_curve.log").exists()  # folded into gpu_check.log
    (tmp_path / "fail").mkdir()
    lines, _ = run_train_step(tmp_path / "fail", 1)
    assert lines[0] == "FAILED training curves (exit 1): VERDICT: fused gap 1e-3, noise 1e-2" and lines[-1] == "STATUS=5"
