// The CPU layer's projections, x W^T + b on token-major rows: the kernel of
// csrc/kernels/cpu/linear_kernel.h, split across threads, where it applies (float32, AVX-512 or
// AVX2/FMA, a row- or column-major weight, up to kLinearKernelMaxWork multiply-adds, unless a
// forced `microkernel` backend lifts the limit); otherwise the GEMM library in force
// (csrc/kernels/cpu/gemm_backend.h): OpenBLAS, or ATen's addmm.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace attn_export::ops {

at::Tensor project_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);

// The same, written into `out` ([rows, out_features], unit column stride, rows any distance
// apart: e.g. one half of a [rows, 2E] buffer).
void project_into_cpu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias);

}  // namespace attn_export::ops
