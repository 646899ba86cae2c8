#!/usr/bin/env bash
# The GPU check of the CUDA kernels, for a machine with an NVIDIA GPU, a CUDA build of PyTorch
# and nvcc, and no network. In under 8 minutes on an H200 it
#   1. builds attn_export for this GPU only (TORCH_CUDA_ARCH_LIST from its compute capability),
#   2. runs the GPU tests (the `cuda`-marked tests: tests/ops/test_cuda.py, the device-parametrized
#      operator and layer tests, and ONNX Runtime's CUDA and TensorRT execution providers in
#      tests/validation/test_ort_providers.py, which skip with the reason without onnxruntime-gpu; with pytest
#      if installed, else with tests/run_without_pytest.py), then tests/ops/test_cuda.py again with
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
# 4 the sanitizer reported an error in attn_export's kernels, or the program failed under it.
# GPU_CHECK_STEPS="tests sanitize bench" (the default) picks the steps after the build.
# The Hopper (sm_90a) forward, not yet run on a GPU (docs/cuda.md "Hopper forward"): on a
# compute-capability-9 GPU the build targets 9.0a when the CUTLASS headers are at hand (the
# nvidia-cutlass package, or ATTN_EXPORT_CUTLASS_INCLUDE: this machine has no network, so carry an
# unpacked `pip download nvidia-cutlass==4.2.0.0`), and the step `sm90` runs tests/ops/test_cuda_sm90.py
# with ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 (after a smoke run of one call per schedule
# under a 120-s timeout, sm90_smoke.log, which skips the step if it fails or hangs), then leaves
# ATTN_EXPORT_CUDA_SM90=1 set for the steps after it: GPU_CHECK_STEPS="sm90 sanitize bench" verifies
# it in one run.
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

log() { echo "[gpu_check +$((SECONDS - START))s] $*"; }
summary() { echo "$*" | tee -a "$OUT_DIR/summary.txt"; }
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
log "building for sm_${CAPABILITY/./} (CUDA_HOME=$CUDA_HOME, MAX_JOBS=$MAX_JOBS)"
# An editable install needs no network with these flags; where pip cannot install (e.g. a
# read-only environment), build in place and import the package from a symlink.
if timeout 300 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . > "$OUT_DIR/build.log" 2>&1; then
  log "installed with pip (editable)"
else
  log "pip install failed (see build.log); building in place"
  if ! timeout 300 "$PY" setup.py build_ext --inplace >> "$OUT_DIR/build.log" 2>&1; then
    summary "FAILED build (see build.log)"; tail -30 "$OUT_DIR/build.log"; exit 1
  fi
  mkdir -p "$OUT_DIR/pythonpath"
  ln -sfn "$ROOT/exporter" "$OUT_DIR/pythonpath/attn_export"
  export PYTHONPATH="$OUT_DIR/pythonpath${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c 'import torch, attn_export; from attn_export import spec; assert torch._C._dispatch_has_kernel_for_dispatch_key(spec.load().torch_op_attention, "CUDA"), "no CUDA kernels registered"' >> "$OUT_DIR/build.log" 2>&1; then
  summary "FAILED build: attn_export does not load with its CUDA kernels (see build.log)"; tail -30 "$OUT_DIR/build.log"; exit 1
fi
summary "PASSED build for sm_${CAPABILITY/./} in $((SECONDS - START)) s"

# ---- 2. GPU tests
tests_step() {
  GPU_TEST_MODULES="ops/test_cuda ops/test_attention_op ops/test_module_parity validation/test_ort_providers"
  log "running the cuda tests of: $GPU_TEST_MODULES"
  T0=$SECONDS
  if "$PY" -c 'import pytest' 2>/dev/null; then
    timeout 270 "$PY" -m pytest -m cuda $(printf 'tests/%s.py ' $GPU_TEST_MODULES) -q -rf -p no:cacheprovider \
      --junitxml "$OUT_DIR/test_cuda.xml" > "$OUT_DIR/test_cuda.log" 2>&1
  else
    # the stand-in ignores marks: the device-parametrized modules are filtered to their cuda ids
    ( timeout 150 "$PY" tests/run_without_pytest.py ops/test_cuda --junit "$OUT_DIR/test_cuda.xml" &&
      for m in ops/test_attention_op ops/test_module_parity; do
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
  local T0=$SECONDS rc
  log "running tests/ops/test_cuda.py with ATTN_EXPORT_CUDA_PREVIEW=1"
  if "$PY" -c 'import pytest' 2>/dev/null; then
    ATTN_EXPORT_CUDA_PREVIEW=1 timeout 240 "$PY" -m pytest -m cuda tests/ops/test_cuda.py -q -rf -p no:cacheprovider \
      > "$OUT_DIR/test_cuda_preview.log" 2>&1
  else
    ATTN_EXPORT_CUDA_PREVIEW=1 timeout 240 "$PY" tests/run_without_pytest.py ops/test_cuda > "$OUT_DIR/test_cuda_preview.log" 2>&1
  fi
  rc=$?
  tail -5 "$OUT_DIR/test_cuda_preview.log"
  if [ $rc -eq 0 ]; then
    summary "PASSED preview tests in $((SECONDS - T0)) s: $(tail -1 "$OUT_DIR/test_cuda_preview.log")"
  else
    summary "FAILED preview tests (exit $rc): $(tail -1 "$OUT_DIR/test_cuda_preview.log")"
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
  local sanitizer tool rc log ours crashed T0=$SECONDS failed=0
  sanitizer=$(command -v compute-sanitizer || ls "${CUDA_HOME}"/bin/compute-sanitizer 2>/dev/null || true)
  if [ -z "$sanitizer" ]; then
    summary "SKIPPED sanitizer: compute-sanitizer not found"; return 0
  fi
  : > "$OUT_DIR/sanitize.log"
  for tool in memcheck racecheck initcheck synccheck; do
    log="$OUT_DIR/sanitize_$tool.log"
    # No caching allocator: every tensor its own allocation, so an overrun leaves it.
    ATTN_EXPORT_CUDA_PREVIEW=${CHECK_PREVIEW:-1} PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZE_TIMEOUT_S:-120}" "$sanitizer" --tool $tool \
      --print-limit 1000 --error-exitcode 9 "$PY" scripts/gpu_sanitize.py $([ $tool = memcheck ] || echo --quick) \
      $([ $tool = initcheck ] && echo --no-layer) > "$log" 2>&1
    rc=$?
    ours=$(grep -E "^=========.* at .*attn_export::" "$log" | grep -vc "Host Frame")
    crashed=$(grep -c "Target application returned an error" "$log")
    { echo "== $tool: exit $rc, reports naming attn_export's kernels: $ours"; cat "$log"; } >> "$OUT_DIR/sanitize.log"
    rm -f "$log"
    if [ $rc -eq 124 ]; then
      summary "INCONCLUSIVE sanitizer: $tool timed out after ${SANITIZE_TIMEOUT_S:-120} s (see sanitize.log)"
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
  local T0=$SECONDS rc
  log "running tests/ops/test_cuda_sm90_bwd.py with ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1"
  if "$PY" -c 'import pytest' 2>/dev/null; then
    ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout 300 "$PY" -m pytest -m cuda tests/ops/test_cuda_sm90_bwd.py -q -rfs \
      -p no:cacheprovider > "$OUT_DIR/test_cuda_sm90_bwd.log" 2>&1
  else
    ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout 300 "$PY" tests/run_without_pytest.py ops/test_cuda_sm90_bwd \
      > "$OUT_DIR/test_cuda_sm90_bwd.log" 2>&1
  fi
  rc=$?
  tail -5 "$OUT_DIR/test_cuda_sm90_bwd.log"
  if [ $rc -eq 0 ]; then
    summary "PASSED sm90 backward tests in $((SECONDS - T0)) s: $(tail -1 "$OUT_DIR/test_cuda_sm90_bwd.log")"
  else
    summary "FAILED sm90 backward tests (exit $rc): $(tail -1 "$OUT_DIR/test_cuda_sm90_bwd.log")"
    STATUS=2
  fi
}

# ---- The Hopper forward: its parity tests, then ATTN_EXPORT_CUDA_SM90=1 for the steps after this one.
sm90_step() {
  local T0=$SECONDS rc
  case "$TORCH_CUDA_ARCH_LIST" in
    *9.0a*) ;;
    *) summary "SKIPPED sm90: built for $TORCH_CUDA_ARCH_LIST, not 9.0a (no CUTLASS headers: see the header)"; return 0 ;;
  esac
  # First one call of each schedule, forward and backward (deterministic too), under a short
  # timeout: a kernel that hangs (a barrier's count, a pipeline's phase) would otherwise hold the
  # suites below for their whole timeouts (480 + 300 s) before failing.
  log "sm90 smoke: one forward and backward per schedule, 120 s at most"
  ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout 120 "$PY" - > "$OUT_DIR/sm90_smoke.log" 2>&1 <<'PY'
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
  if [ $rc -ne 0 ]; then
    tail -5 "$OUT_DIR/sm90_smoke.log"
    summary "FAILED sm90 smoke (exit $rc; 124: a kernel hung): the sm90 suites are skipped (see sm90_smoke.log)"
    STATUS=2
    return 0
  fi
  # 480 s: six head dims since issue 47's second step (twice the parity cases of the first)
  log "running tests/ops/test_cuda_sm90.py with ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1"
  if "$PY" -c 'import pytest' 2>/dev/null; then
    ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout 480 "$PY" -m pytest -m cuda tests/ops/test_cuda_sm90.py -q -rfs \
      -p no:cacheprovider > "$OUT_DIR/test_cuda_sm90.log" 2>&1
  else
    ATTN_EXPORT_CUDA_PREVIEW=1 ATTN_EXPORT_CUDA_SM90=1 timeout 480 "$PY" tests/run_without_pytest.py ops/test_cuda_sm90 \
      > "$OUT_DIR/test_cuda_sm90.log" 2>&1
  fi
  rc=$?
  tail -5 "$OUT_DIR/test_cuda_sm90.log"
  if [ $rc -eq 0 ]; then
    summary "PASSED sm90 tests in $((SECONDS - T0)) s: $(tail -1 "$OUT_DIR/test_cuda_sm90.log")"
  else
    summary "FAILED sm90 tests (exit $rc): $(tail -1 "$OUT_DIR/test_cuda_sm90.log")"
    STATUS=2
  fi
  sm90_bwd_tests
  export ATTN_EXPORT_CUDA_SM90=1  # the sanitizer and the benchmark after this step run the Hopper forward
}

# GPU_CHECK_STEPS picks the steps after the build, e.g. GPU_CHECK_STEPS=sanitize to rerun one.
STATUS=0
for step in ${GPU_CHECK_STEPS:-tests sanitize bench}; do
  case $step in
    tests) tests_step ;;
    sanitize) sanitize_step ;;
    bench) bench_step ;;
    sm90) sm90_step ;;
    *) summary "FAILED: unknown step '$step' in GPU_CHECK_STEPS (tests, sanitize, bench, sm90)"; exit 1 ;;
  esac
done

summary "total $((SECONDS - START)) s"
exit $STATUS
