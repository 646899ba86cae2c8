#!/usr/bin/env bash
# The GPU check of the CUDA kernels, for a machine with an NVIDIA GPU, a CUDA build of PyTorch
# and nvcc, and no network. In under 8 minutes on an H200 it
#   1. builds attn_export for this GPU only (TORCH_CUDA_ARCH_LIST from its compute capability),
#   2. runs the GPU tests (the `cuda`-marked tests: tests/ops/cuda/test_cuda.py, the device-parametrized
#      operator and layer tests, and ONNX Runtime's CUDA and TensorRT execution providers in
#      tests/validation/test_ort_providers.py, which skip with the reason without onnxruntime-gpu; with pytest
#      if installed, else with tests/run_without_pytest.py), then tests/ops/cuda/test_cuda.py again with
#      ATTN_EXPORT_CUDA_PREVIEW=1: the paths that wait for a GPU (docs/cuda.md "Preview"),
#   3. runs every kernel path once under compute-sanitizer's memcheck, and a few under racecheck,
#      initcheck and synccheck (scripts/gpu_sanitize.py; skipped with a line in the summary where
#      the tool is missing), with the preview paths on (CHECK_PREVIEW, default 1),
#   4. runs the GPU benchmark (benchmarks/gpu.py: attn_export against every SDPA backend; GPU_BENCH_ARGS),
#      with the preview paths on (CHECK_PREVIEW; CHECK_PREVIEW=0 measures the default dispatch),
# and writes everything under $OUT if set, else ./gpu_check_out:
#   environment.txt  build.log  test_cuda.log  test_cuda.xml  test_cuda_preview.log  sanitize.log  bench_gpu.log
#   bench_gpu.md  bench_gpu.json  summary.txt  gpu_check.log
# Exit status: 0 all passed; 1 the build failed; 2 tests failed; 3 the benchmark failed;
# 4 the sanitizer reported an error in attn_export's kernels, or the program failed under it;
# 5 the training curves differ (step `train`).
# GPU_CHECK_STEPS="tests sanitize bench" (the default) picks the steps after the build.
# The Hopper (sm_90a) forward, not yet run on a GPU (docs/cuda.md "Hopper forward"): on a
# compute-capability-9 GPU the build targets 9.0a when the CUTLASS headers are at hand (the
# nvidia-cutlass package, or ATTN_EXPORT_CUTLASS_INCLUDE: this machine has no network, so carry an
# unpacked `pip download nvidia-cutlass==4.2.0.0`), and the step `sm90` runs tests/ops/cuda/test_cuda_sm90.py
# with ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 (after a smoke run of one call per schedule
# under a 120-s timeout, sm90_smoke.log, which skips the step if it fails or hangs), then leaves
# ATTN_EXPORT_CUDA_SM90=1 set for the steps after it: GPU_CHECK_STEPS="sm90 sanitize bench" verifies
# it in one run.
# GPU_CHECK_STEPS=train trains a small causal LM 3 x 200 steps (scripts/train_curve.py --device cuda:
# bfloat16 autocast, head dim 128) with nn.MultiheadAttention and with the fused operator, under the
# switches set (ATTN_EXPORT_CUDA_SM90=1 for the Hopper kernels), and compares the loss curves
# (train_curve/curve.md, curve.json, the attention kernels each run launched).
# GPU_CHECK_STEPS=sm90quick is the first call of a GPU session (docs/testing.md "The next GPU session,
# call by call"): the build, the smoke run, the quick tier of the sm90 tests (-m sm90_quick, one case
# per code path) and the headline benchmark rows (bench_headline.md/.json), within GPU_CHECK_BUDGET_S
# (default 540 s there: one 600-s call), at most 8 files under $OUT (what the device tool brings back).
# Where GPU_CHECK_BUDGET_S is set, each step's timeout is cut to what is left of it, and a step that no
# longer fits says so in summary.txt. The build is reused where this machine built the same sources
# for the same architectures before (a warm machine's second call; GPU_CHECK_REBUILD=1 forces it).
#
#   scripts/gpu_check.sh                 # PYTHON=... to pick the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT_DIR=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
PY=${PYTHON:-python3}
START=$SECONDS
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
case " ${GPU_CHECK_STEPS:-} " in *" sm90quick "*) : "${GPU_CHECK_BUDGET_S:=540}" ;; esac

log() { echo "[gpu_check +$((SECONDS - START))s] $*"; }
summary() { echo "$*" | tee -a "$OUT_DIR/summary.txt"; }
# A step's timeout: its own ($1), cut to what is left of GPU_CHECK_BUDGET_S (less 10 s for the
# summary) where that is set, so the caller's own limit never kills the run before it says why.
capped() {
  [ -n "${GPU_CHECK_BUDGET_S:-}" ] || { echo "$1"; return; }
  local left=$((GPU_CHECK_BUDGET_S - (SECONDS - START) - 10))
  [ $left -ge 1 ] || left=1  # `timeout 0` would wait for ever
  echo $(($1 < left ? $1 : left))
}
# fits WHAT NEEDED_S TIMEOUT_S: false, with a SKIPPED line, when the capped timeout is under NEEDED_S.
fits() {
  [ "$3" -ge "$2" ] && return 0
  summary "SKIPPED $1: $3 s left of GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-}, it needs ~$2 s"; return 1
}
: > "$OUT_DIR/summary.txt"

# ---- 0. Environment fingerprint
{
  date -u
  nvidia-smi || true
  (command -v nvcc && nvcc --version) || echo "nvcc not on PATH"
  git rev-parse HEAD 2>/dev/null || true
  "$PY" - <<'PY'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("gpu", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
PY
} > "$OUT_DIR/environment.txt" 2>&1
cat "$OUT_DIR/environment.txt"

# A misspelt step fails before the build, not after it.
for step in ${GPU_CHECK_STEPS:-tests sanitize bench}; do
  case $step in
    tests | sanitize | bench | sm90 | sm90quick | train) ;;
    *) summary "FAILED: unknown step '$step' in GPU_CHECK_STEPS (tests, sanitize, bench, sm90, sm90quick, train)"; exit 1 ;;
  esac
done

# ---- 1. Build for this GPU
CAPABILITY=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))') || {
  summary "FAILED build: torch sees no GPU"; exit 1; }
# Hopper: sm_90a code (the Hopper forward) when its CUTLASS headers can be found, else plain sm_90.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ] && [ "$CAPABILITY" = 9.0 ] && { [ -d "${ATTN_EXPORT_CUTLASS_INCLUDE:-/nonexistent}/cute" ] ||
    "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("cutlass_library") is None)' 2>/dev/null; }; then
  CAPABILITY=9.0a
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$CAPABILITY}
export ATTN_EXPORT_CUDA=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${CUDA_HOME:-}" ]; then
  NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
fi
# The 9.0a build compiles 48 CuTe units (24 forward, 24 backward; 15-50 s of one core each) beside
# the sm80-style ones: an estimated 2.5-5 minutes at MAX_JOBS=16 (docs/testing.md), hence 480 s there.
if [ -z "${BUILD_TIMEOUT_S:-}" ]; then
  case "$TORCH_CUDA_ARCH_LIST" in *9.0a*) BUILD_TIMEOUT_S=480 ;; *) BUILD_TIMEOUT_S=300 ;; esac
fi
build_loads() {
  "$PY" -c 'import torch, attn_export; from attn_export import spec; assert torch._C._dispatch_has_kernel_for_dispatch_key(spec.load().torch_op_attention, "CUDA"), "no CUDA kernels registered"'
}
# What a build depends on: the C++/CUDA sources, setup.py and the architectures.
source_stamp() {
  { echo "$TORCH_CUDA_ARCH_LIST"; find csrc setup.py -type f -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16
}
build_step() {
  local stamp_file=$ROOT/build/gpu_check_build.stamp stamp timeout_s rc
  stamp=$(source_stamp)
  if [ "${GPU_CHECK_REBUILD:-0}" != 1 ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] && build_loads > "$OUT_DIR/build.log" 2>&1; then
    summary "PASSED build for sm_${CAPABILITY/./}: reused this machine's earlier build of the same sources"; return 0
  fi
  timeout_s=$(capped "$BUILD_TIMEOUT_S")
  log "building for sm_${CAPABILITY/./} (CUDA_HOME=$CUDA_HOME, MAX_JOBS=$MAX_JOBS, at most $timeout_s s)"
  # An editable install needs no network with these flags; where pip cannot install (e.g. a
  # read-only environment), build in place and import the package from a symlink. A pip that ran
  # out of time is not retried in place: that would take as long again.
  # -v: the compiler's progress ([done/all] from ninja) reaches build.log, also when time runs out.
  timeout "$timeout_s" "$PY" -m pip install -v --no-build-isolation --no-deps --no-index -e . > "$OUT_DIR/build.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    log "installed with pip (editable)"
  elif [ $rc -eq 124 ]; then
    build_timed_out "$timeout_s"; return 1
  else
    log "pip install failed (see build.log); building in place"
    timeout_s=$(capped "$BUILD_TIMEOUT_S")
    timeout "$timeout_s" "$PY" setup.py build_ext --inplace >> "$OUT_DIR/build.log" 2>&1
    rc=$?
    [ $rc -eq 124 ] && { build_timed_out "$timeout_s"; return 1; }
    [ $rc -eq 0 ] || { summary "FAILED build (see build.log)"; tail -30 "$OUT_DIR/build.log"; return 1; }
    mkdir -p "$OUT_DIR/pythonpath"
    ln -sfn "$ROOT/exporter" "$OUT_DIR/pythonpath/attn_export"
    export PYTHONPATH="$OUT_DIR/pythonpath${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if ! build_loads >> "$OUT_DIR/build.log" 2>&1; then
    summary "FAILED build: attn_export does not load with its CUDA kernels (see build.log)"; tail -30 "$OUT_DIR/build.log"; return 1
  fi
  mkdir -p "$ROOT/build" && echo "$stamp" > "$stamp_file"
  summary "PASSED build for sm_${CAPABILITY/./} in $((SECONDS - START)) s"
}
build_timed_out() {
  tail -5 "$OUT_DIR/build.log"
  local reached
  reached=$(grep -o '\[[0-9]*/[0-9]*\]' "$OUT_DIR/build.log" | tail -1)
  summary "FAILED build: timed out after $1 s for sm_${CAPABILITY/./} at MAX_JOBS=$MAX_JOBS" \
    "(compile steps done: ${reached:-none logged}; see build.log): raise BUILD_TIMEOUT_S and GPU_CHECK_BUDGET_S"
}
build_step || exit 1

# ---- 2. GPU tests
tests_step() {
  GPU_TEST_MODULES="ops/cuda/test_cuda ops/core/test_attention_op ops/module/test_module_parity validation/test_ort_providers"
  log "running the cuda tests of: $GPU_TEST_MODULES"
  T0=$SECONDS
  if "$PY" -c 'import pytest' 2>/dev/null; then
    timeout 270 "$PY" -m pytest -m cuda $(printf 'tests/%s.py ' $GPU_TEST_MODULES) -q -rf -p no:cacheprovider \
      --junitxml "$OUT_DIR/test_cuda.xml" > "$OUT_DIR/test_cuda.log" 2>&1
  else
    # the stand-in ignores marks: the device-parametrized modules are filtered to their cuda ids
    ( timeout 150 "$PY" tests/run_without_pytest.py ops/cuda/test_cuda --junit "$OUT_DIR/test_cuda.xml" &&
      for m in ops/core/test_attention_op ops/module/test_module_parity; do
        timeout 60 "$PY" tests/run_without_pytest.py "$m" -k cuda --junit "$OUT_DIR/$(basename $m).xml" || exit 1
      done &&
      timeout 120 "$PY" tests/run_without_pytest.py validation/test_ort_providers -k ::test_cuda_ \
        --junit "$OUT_DIR/test_ort_providers.xml" ) > "$OUT_DIR/test_cuda.log" 2>&1
  fi
  TEST_RC=$?
  tail -15 "$OUT_DIR/test_cuda.log"
  if [ $TEST_RC -eq 0 ]; then
    summary "PASSED tests in $((SECONDS - T0)) s: $(tail -1 "$OUT_DIR/test_cuda.log")"
  else
    [ $TEST_RC -eq 124 ] && summary "FAILED tests: timed out after $((SECONDS - T0)) s" \
                         || summary "FAILED tests (exit $TEST_RC): $(tail -1 "$OUT_DIR/test_cuda.log")"
    STATUS=2
  fi
  preview_tests
}

# The same GPU tests of the kernels with the preview switch on: further flash head dims, grouped-query
# heads and the bottom-right alignment in the kernels, split-KV decoding (docs/cuda.md "Preview").
preview_tests() {
  [ "${CHECK_PREVIEW:-1}" = 1 ] || { summary "SKIPPED preview tests: CHECK_PREVIEW=${CHECK_PREVIEW}"; return 0; }
  run_gpu_tests "preview tests" ops/cuda/test_cuda 240 test_cuda_preview.log ATTN_EXPORT_CUDA_PREVIEW=1
}

# One module of GPU tests, tests/MODULE.py, its `cuda` tests under pytest (else under
# tests/run_without_pytest.py), within SECONDS and with the environment's VAR=value pairs given,
# into $OUT_DIR/LOG; then its summary line, LABEL (STATUS=2 where it fails).
#   run_gpu_tests LABEL MODULE SECONDS LOG [VAR=value ...]
run_gpu_tests() {
  local label=$1 module=$2 seconds=$3 out="$OUT_DIR/$4" T0=$SECONDS rc
  shift 4
  log "running tests/$module.py${*:+ with $*}"
  if "$PY" -c 'import pytest' 2>/dev/null; then
    env "$@" timeout "$seconds" "$PY" -m pytest -m cuda "tests/$module.py" -q -rfs -p no:cacheprovider $CASE_TIMEOUT \
      > "$out" 2>&1
  else
    env "$@" timeout "$seconds" "$PY" tests/run_without_pytest.py "$module" > "$out" 2>&1
  fi
  rc=$?
  tail -5 "$out"
  if [ $rc -eq 0 ]; then
    summary "PASSED $label in $((SECONDS - T0)) s: $(tail -1 "$out")"
  else
    summary "FAILED $label (exit $rc): $(tail -1 "$out")"
    STATUS=2
  fi
}

# ---- 3. compute-sanitizer: out-of-bounds accesses, uninitialized reads and shared-memory races the
# tests cannot see. Every kernel of the run is instrumented: with --kernel-name the uninstrumented
# kernels' writes (torch.randn's) are invisible to initcheck, whose reports are then false, and
# racecheck failed inside the sanitizer. A report counts against attn_export only where it names one
# of its kernels: cuBLAS's Hopper GEMMs (nvjet_*, the layer's projections) show racecheck hazards,
# and initcheck does not see their writes, so it runs without the layer (gpu_sanitize.py).
sanitize_step() {
  local sanitizer tool rc log ours crashed T0=$SECONDS failed=0 timeout_s
  sanitizer=$(command -v compute-sanitizer || ls "${CUDA_HOME}"/bin/compute-sanitizer 2>/dev/null || true)
  if [ -z "$sanitizer" ]; then
    summary "SKIPPED sanitizer: compute-sanitizer not found"; return 0
  fi
  : > "$OUT_DIR/sanitize.log"
  for tool in memcheck racecheck initcheck synccheck; do
    log="$OUT_DIR/sanitize_$tool.log"
    timeout_s=$(capped "${SANITIZE_TIMEOUT_S:-120}")
    # No caching allocator: every tensor its own allocation, so an overrun leaves it.
    ATTN_EXPORT_CUDA_PREVIEW=${CHECK_PREVIEW:-1} PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$timeout_s" "$sanitizer" --tool $tool \
      --print-limit 1000 --error-exitcode 9 "$PY" scripts/gpu_sanitize.py $([ $tool = memcheck ] || echo --quick) \
      $([ $tool = initcheck ] && echo --no-layer) > "$log" 2>&1
    rc=$?
    ours=$(grep -E "^=========.* at .*attn_export::" "$log" | grep -vc "Host Frame")
    crashed=$(grep -c "Target application returned an error" "$log")
    { echo "== $tool: exit $rc, reports naming attn_export's kernels: $ours"; cat "$log"; } >> "$OUT_DIR/sanitize.log"
    rm -f "$log"
    if [ $rc -eq 124 ]; then
      summary "INCONCLUSIVE sanitizer: $tool timed out after $timeout_s s (see sanitize.log)"
    elif [ "$ours" -gt 0 ] || [ "$crashed" -gt 0 ] || { [ $rc -ne 0 ] && [ $rc -ne 9 ]; }; then
      failed=1
      summary "FAILED sanitizer: $tool exit $rc, $ours reports in attn_export's kernels$([ "$crashed" -gt 0 ] && echo ', the program failed') (see sanitize.log)"
    elif [ $rc -eq 9 ]; then
      summary "PASSED sanitizer: $tool, no report in attn_export's kernels (others' kernels reported: see sanitize.log)"
    else
      summary "PASSED sanitizer: $tool, no report"
    fi
  done
  log "sanitizer done in $((SECONDS - T0)) s"
  [ $failed -eq 0 ] || { [ $STATUS -eq 0 ] && STATUS=4; }
}

# ---- 4. Benchmark, with what is left of the 8 minutes (GPU_CHECK_BUDGET_S, minus a margin).
# benchmarks/gpu.py prints its estimate first and skips the cases that no longer fit the budget;
# GPU_BENCH_ARGS picks them (default --quick: every group, fewer rows), e.g.
#   GPU_CHECK_STEPS=bench GPU_CHECK_BUDGET_S=540 GPU_BENCH_ARGS="--cases prefill" scripts/gpu_check.sh
bench_step() {
  BUDGET=$((${GPU_CHECK_BUDGET_S:-450} - (SECONDS - START) - 40))
  [ $BUDGET -lt 30 ] && BUDGET=30
  log "benchmark, budget ${BUDGET} s, arguments: ${GPU_BENCH_ARGS---quick}"
  T0=$SECONDS
  # shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of arguments
  if ATTN_EXPORT_CUDA_PREVIEW=${CHECK_PREVIEW:-1} timeout $((BUDGET + 60)) "$PY" -m benchmarks.gpu --out "$OUT_DIR" --budget-s "$BUDGET" ${GPU_BENCH_ARGS---quick} \
      > "$OUT_DIR/bench_gpu.log" 2>&1; then
    summary "PASSED benchmark in $((SECONDS - T0)) s (bench_gpu.md): $(tail -1 "$OUT_DIR/bench_gpu.log")"
  else
    summary "FAILED benchmark (see bench_gpu.log)"; tail -20 "$OUT_DIR/bench_gpu.log"
    [ $STATUS -eq 0 ] && STATUS=3
  fi
}

# ---- The Hopper backward's gradient tests (part of the sm90 step; the build is 9.0a there).
sm90_bwd_tests() {
  run_gpu_tests "sm90 backward tests" ops/cuda/test_cuda_sm90_bwd "$(capped 300)" test_cuda_sm90_bwd.log \
    ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1
}

# ---- The Hopper kernels need the 9.0a build.
sm90_built() {
  case "$TORCH_CUDA_ARCH_LIST" in
    *9.0a*) return 0 ;;
    *) summary "SKIPPED $1: built for $TORCH_CUDA_ARCH_LIST, not 9.0a (no CUTLASS headers: see the header)"; return 1 ;;
  esac
}

# One call of each schedule, forward and backward (deterministic too), under a short timeout: a
# kernel that hangs (a barrier's count, a pipeline's phase) would otherwise hold the suites after it
# for their whole timeouts before failing. False (and the suites skipped) where it fails.
sm90_smoke() {
  local rc timeout_s
  timeout_s=$(capped 120)
  fits "sm90 smoke and the sm90 suites" 30 "$timeout_s" || { STATUS=2; return 1; }
  log "sm90 smoke: one forward and backward per schedule, $timeout_s s at most"
  ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout "$timeout_s" "$PY" - > "$OUT_DIR/sm90_smoke.log" 2>&1 <<'PY'
import torch
import attn_export
for d, causal, deterministic in [(128, True, False), (64, False, False), (256, False, False), (128, False, True)]:
    torch.use_deterministic_algorithms(deterministic)
    q, k, v = (torch.randn(2, 4, 1025, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    out = attn_export.attention(q, k, v, is_causal=causal)
    out.float().sum().backward()
    torch.cuda.synchronize()
    print(f"d{d} causal={causal} deterministic={deterministic}: finite={bool(torch.isfinite(q.grad).all())}", flush=True)
PY
  rc=$?
  [ $rc -eq 0 ] && return 0
  tail -5 "$OUT_DIR/sm90_smoke.log"
  summary "FAILED sm90 smoke (exit $rc; 124: a kernel hung): the sm90 suites are skipped (see sm90_smoke.log)"
  STATUS=2
  return 1
}

# ---- The Hopper forward: its parity tests, then ATTN_EXPORT_CUDA_SM90=1 for the steps after this one.
sm90_step() {
  sm90_built sm90 || return 0
  sm90_smoke || return 0
  # 480 s: six head dims since issue 47's second step (twice the parity cases of the first)
  run_gpu_tests "sm90 tests" ops/cuda/test_cuda_sm90 "$(capped 480)" test_cuda_sm90.log \
    ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1
  sm90_bwd_tests
  export ATTN_EXPORT_CUDA_SM90=1  # the sanitizer and the benchmark after this step run the Hopper forward
}

# A case that hangs (a kernel that never finishes) ends the pytest run with every thread's stack and
# the case's name in the log (pytest-timeout, on the GPU image; an unknown option only warns elsewhere).
CASE_TIMEOUT="-o timeout=${CASE_TIMEOUT_S:-90} -o timeout_method=thread"

# ---- The first call of a GPU session: after the build, the smoke run, the quick tier of the sm90
# tests and the headline benchmark rows, each cut to GPU_CHECK_BUDGET_S (540 s by default here).
sm90quick_step() {
  sm90_built sm90quick || return 0
  sm90_smoke || return 0
  sm90_quick_tests
  headline_bench
  export ATTN_EXPORT_CUDA_SM90=1
}

# The cases of both sm90 files marked sm90_quick (SM90_QUICK in each; one per code path): ~53 cases,
# an estimated 30-120 s on an H100 (docs/testing.md). -v names each case as it starts, --durations
# gives the per-case times that size the full suites' call.
sm90_quick_tests() {
  local T0=$SECONDS rc timeout_s last
  timeout_s=$(capped 180)
  fits "sm90 quick tier" 60 "$timeout_s" || { STATUS=2; return 0; }
  "$PY" -c 'import pytest' 2>/dev/null || { summary "FAILED sm90 quick tier: it needs pytest (a marker)"; STATUS=2; return 0; }
  log "sm90 quick tier (-m sm90_quick), $timeout_s s at most"
  ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout "$timeout_s" "$PY" -m pytest -m "cuda and sm90_quick" \
    tests/ops/cuda/test_cuda_sm90.py tests/ops/cuda/test_cuda_sm90_bwd.py -v -rfs --durations=15 -p no:cacheprovider $CASE_TIMEOUT \
    > "$OUT_DIR/test_sm90_quick.log" 2>&1
  rc=$?
  last=$(tail -1 "$OUT_DIR/test_sm90_quick.log")
  tail -5 "$OUT_DIR/test_sm90_quick.log"
  if [ $rc -eq 0 ] && [[ "$last" == *" passed"* ]]; then
    summary "PASSED sm90 quick tier in $((SECONDS - T0)) s: $last"
  elif [ $rc -eq 0 ]; then  # every case skipped: nothing was verified
    summary "FAILED sm90 quick tier: no case ran ($last; the skip reasons are in test_sm90_quick.log)"; STATUS=2
  elif [ $rc -eq 124 ]; then
    summary "FAILED sm90 quick tier: timed out after $timeout_s s (the last case started is the last line of test_sm90_quick.log)"; STATUS=2
  else
    summary "FAILED sm90 quick tier (exit $rc; 'Timeout' in the log: a case hung): $last"; STATUS=2
  fi
}

# The headline rows of issues 46-48, bf16 against SDPA's best backend: head dim 128 forward and
# forward+backward at seq 4096 (causal and not), head dim 256 causal, decode at a 32k cache (GB/s).
# HEADLINE_DRY_RUN=1: tiny sizes on the CPU (tests/test_gpu_scripts.py).
headline_bench() {
  local T0=$SECONDS rc timeout_s
  timeout_s=$(capped 150)
  fits "headline benchmark" 40 "$timeout_s" || return 0
  log "headline benchmark, $timeout_s s at most"
  ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout "$timeout_s" "$PY" - "$OUT_DIR" $((timeout_s - 20)) \
    ${HEADLINE_DRY_RUN:+--dry-run} > "$OUT_DIR/bench_headline.log" 2>&1 <<'PY'
import json, pathlib, sys, types
from benchmarks import gpu
from benchmarks.gpu_cases import MODES, Case, dry_run_case
from benchmarks.gpu_impls import impls_for
from benchmarks.gpu_plan import case_s
from benchmarks.gpu_report import hbm_peak_tbs, markdown
out, budget_s, dry = pathlib.Path(sys.argv[1]), float(sys.argv[2]), "--dry-run" in sys.argv
cases = [Case("prefill", "bfloat16", m, 4, 16, 4096, 4096, 128, causal) for causal in (False, True) for m in MODES]
cases += [Case("hdims", "bfloat16", m, 4, 8, 4096, 4096, 256, True) for m in MODES]
cases += [Case("decode", "bfloat16", "forward", 16, 32, 1, 32768, 128, kv_heads=h) for h in (32, 8)]
args = types.SimpleNamespace(quick=True, blocks=3, dry_run=dry)  # what gpu.timing_for reads
cases = [dry_run_case(c) for c in cases] if dry else cases
timing = gpu.timing_for(args)
estimates = [case_s(c, impls_for(c), timing) for c in cases]
gpu.print_plan(cases, estimates, budget_s)
device = "cpu" if dry else "cuda"
env = gpu.environment(device)
rows, skipped = gpu.run_cases(cases, estimates, timing, device, budget_s, None if dry else hbm_peak_tbs(env["gpu"]))
command = "scripts/gpu_check.sh headline_bench" + (" (dry run)" if dry else "")
(out / "bench_headline.json").write_text(json.dumps(
    dict(environment=env, command=command, results=rows, skipped=[c.label() for c in skipped]), indent=2))
(out / "bench_headline.md").write_text(markdown(env, command, rows, skipped))
for r in rows:
    ratio = "n/a" if r["ours_vs_best"] is None else f"{r['ours_vs_best']:.2f}"
    print(f"headline: {r['label']}: attn_export / {r['best']} = {ratio}")
print(f"{len(rows)} rows, {len(skipped)} skipped")
PY
  rc=$?
  grep '^headline: ' "$OUT_DIR/bench_headline.log" | tee -a "$OUT_DIR/summary.txt"
  if [ $rc -eq 0 ]; then
    summary "PASSED headline benchmark in $((SECONDS - T0)) s (bench_headline.md): $(tail -1 "$OUT_DIR/bench_headline.log")"
  else
    summary "FAILED headline benchmark (exit $rc; see the end of gpu_check.log)"; tail -20 "$OUT_DIR/bench_headline.log"
    [ $STATUS -eq 0 ] && STATUS=3
  fi
  cat "$OUT_DIR/bench_headline.log" && rm -f "$OUT_DIR/bench_headline.log"  # into gpu_check.log: 8 files at most
}

# ---- Training: the fused operator's loss curve against nn.MultiheadAttention's (issue 48's 200 steps).
train_step() {
  local T0=$SECONDS rc
  log "training curves (scripts/train_curve.py --device cuda), ATTN_EXPORT_CUDA_SM90=${ATTN_EXPORT_CUDA_SM90:-unset}"
  ATTN_EXPORT_CUDA_PREVIEW=${CHECK_PREVIEW:-1} timeout "$(capped 240)" "$PY" scripts/train_curve.py --device cuda \
      --out "$OUT_DIR/train_curve" > "$OUT_DIR/train_curve.log" 2>&1
  rc=$?
  local verdict
  verdict=$(tail -1 "$OUT_DIR/train_curve.log")
  cat "$OUT_DIR/train_curve.log" && rm -f "$OUT_DIR/train_curve.log"  # into gpu_check.log
  if [ $rc -eq 0 ]; then
    summary "PASSED training curves in $((SECONDS - T0)) s: $verdict"
  else
    summary "FAILED training curves (exit $rc): $verdict"
    [ $STATUS -eq 0 ] && STATUS=5
  fi
}

# GPU_CHECK_STEPS picks the steps after the build, e.g. GPU_CHECK_STEPS=sanitize to rerun one.
STATUS=0
for step in ${GPU_CHECK_STEPS:-tests sanitize bench}; do
  case $step in
    tests) tests_step ;;
    sanitize) sanitize_step ;;
    bench) bench_step ;;
    sm90) sm90_step ;;
    sm90quick) sm90quick_step ;;
    train) train_step ;;
    *) summary "FAILED: unknown step '$step' in GPU_CHECK_STEPS (tests, sanitize, bench, sm90, sm90quick, train)"; exit 1 ;;
  esac
done

summary "total $((SECONDS - START)) s"
exit $STATUS
