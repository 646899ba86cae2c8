// out[m, n] = x[m, k] W[n, k]^T (+ bias[n]) on row-major float32 buffers, exactly as the layer
// runs its projections (project_into_cpu, from _C): the entry point of the GEMM-rate benchmark
// (benchmarks/gemm.py, through ctypes), which times the seam without a layer around it. Built
// by benchmarks/probes.py beside the installed _C, which it links.
#include <ATen/ATen.h>

#include "ops/cpu/projection.h"

extern "C" __attribute__((visibility("default"))) void attn_export_project_f32(
    int64_t m, int64_t n, int64_t k, const float* x, const float* weight, const float* bias, float* out) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor x_t = at::from_blob(const_cast<float*>(x), {m, k}, options);
  const at::Tensor w_t = at::from_blob(const_cast<float*>(weight), {n, k}, options);
  std::optional<at::Tensor> b_t;
  if (bias != nullptr) {
    b_t = at::from_blob(const_cast<float*>(bias), {n}, options);
  }
  attn_export::ops::project_into_cpu(at::from_blob(out, {m, n}, options), x_t, w_t, b_t);
}
