#include "projection.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../multi_head_attention.h"
#include "../../kernels/cpu/gemm_backend.h"
#include "../../kernels/cpu/linear_kernel.h"
#include "../../kernels/cpu/runtime.h"

namespace attn_export::ops {
namespace {

using cpu::GemmBackend;
using cpu::kLinearPanelCols;
using cpu::linear_kernel_available;
using cpu::linear_rows;
using cpu::linear_scratch_floats;
using cpu::LinearArgs;


bool unit_stride(const at::Tensor& t, int64_t dim) {
  return t.stride(dim) == 1 || t.size(dim) <= 1;
}

bool is_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat;
}

bool linear_kernel_applies(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  // A forced `microkernel` backend takes every product the kernel covers, whatever its size.
  // Above linear_kernel_max_work() BLAS takes over: its packing and threads pay for themselves.
  const bool small_enough = x.size(0) * weight.size(0) * weight.size(1) <= cpu::linear_kernel_max_work() ||
                            cpu::gemm_backend() == GemmBackend::microkernel;
  return is_float(x) && is_float(weight) && x.dim() == 2 && weight.dim() == 2 &&
         unit_stride(x, 1) && (unit_stride(weight, 0) || unit_stride(weight, 1)) &&
         (!bias.has_value() || (is_float(*bias) && unit_stride(*bias, 0))) && small_enough &&
         linear_kernel_available();
}

// A 2-D operand as BLAS reads it: row-major (ld = the row stride) or, transposed, column-major.
struct BlasOperand {
  at::Tensor tensor;  // keeps a contiguous copy alive where one was needed
  bool transposed;
  int64_t ld;
};

BlasOperand blas_operand(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= std::max<int64_t>(cols, 1)) {
    return {t, false, t.stride(0)};
  }
  if (t.stride(0) == 1 && t.stride(1) >= std::max<int64_t>(rows, 1)) {
    return {t, true, t.stride(1)};
  }
  const at::Tensor copy = t.contiguous();
  return {copy, false, std::max<int64_t>(cols, 1)};
}

// Whether out = x W^T + b goes to OpenBLAS: it is in force and the operands are float32 or
// float64 of one dtype, with a unit column stride in `out`.
bool openblas_applies(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = x.scalar_type();
  return cpu::gemm_backend() == GemmBackend::openblas && (dtype == at::kFloat || dtype == at::kDouble) &&
         weight.scalar_type() == dtype && out.scalar_type() == dtype && x.dim() == 2 && weight.dim() == 2 &&
         (!bias.has_value() || bias->scalar_type() == dtype) && unit_stride(out, 1) &&
         out.stride(0) >= std::max<int64_t>(out.size(1), 1) && x.size(0) > 0 && weight.size(0) > 0;
}

// out = x W^T (+ b) through runtime.h's blas_gemm, which splits it between at::parallel_for's
// threads, one single-threaded OpenBLAS call each. The bias is written first and accumulated
// onto (beta = 1).
template <typename T>
void run_openblas(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  const BlasOperand a = blas_operand(x);
  // B = W^T: a row-major W is read transposed, a column-major one as it is.
  const BlasOperand w = blas_operand(weight);
  if (bias.has_value()) {
    out.copy_(bias->expand_as(out));
  }
  cpu::blas_gemm(a.transposed, !w.transposed, out.size(0), out.size(1), x.size(1), T(1),
                 a.tensor.data_ptr<T>(), a.ld, w.tensor.data_ptr<T>(), w.ld, T(bias.has_value() ? 1 : 0),
                 out.data_ptr<T>(), out.stride(0));
}

void openblas_project_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  if (x.size(1) == 0) {  // BLAS wants k >= 1; the product is then the bias alone
    bias.has_value() ? out.copy_(bias->expand_as(out)) : out.zero_();
  } else if (x.scalar_type() == at::kFloat) {
    run_openblas<float>(out, x, weight, bias);
  } else {
    run_openblas<double>(out, x, weight, bias);
  }
}

void run_linear_kernel(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  const int64_t m = x.size(0), n = weight.size(0), k = weight.size(1);
  // weight is [n, k]. Column-major, its transpose (the B of C = A B) is row-major [k, n] and
  // read in place; row-major (nn.Linear's layout), the kernel packs it transposed.
  const bool column_major = unit_stride(weight, 0) && !(n > 1 && weight.stride(1) == 1);
  LinearArgs args{m, n, k,
                  x.data_ptr<float>(), x.stride(0),
                  weight.data_ptr<float>(), column_major ? weight.stride(1) : weight.stride(0),
                  bias.has_value() ? bias->data_ptr<float>() : nullptr,
                  out.data_ptr<float>(), out.stride(0)};
  args.b_transposed = !column_major;
  const int64_t work = m * n * k;
  const int64_t threads = std::clamp<int64_t>(work / cpu::kGemmMinWorkPerThread, 1, at::get_num_threads());
  // Split the token rows when they are at least as many as the output features (each thread
  // then packs the whole weight, the smaller operand) or when each thread's rows are few enough
  // for the dot-product path, which packs nothing; else split the weight's column panels (each
  // thread packs only its own, and reads all the rows). Measured at 2
  // threads (docs/benchmarks.md, "CPU GEMMs"): 64-128 tokens against 512-1536 features ran
  // 1.0-1.5x faster split by columns; 32 tokens, on the dot-product path, faster by rows.
  const bool rows_fit_dot_path = args.b_transposed && m <= cpu::kLinearDotMaxRows * threads;
  const bool split_rows = m >= 8 * threads && (m >= n || rows_fit_dot_path);
  const int64_t panels = (n + kLinearPanelCols - 1) / kLinearPanelCols;
  const int64_t parts = split_rows ? threads : std::min(threads, panels);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>(linear_scratch_floats(k)));
    for (int64_t part = begin; part < end; ++part) {
      if (split_rows) {
        linear_rows(args, m * part / parts, m * (part + 1) / parts, 0, n, scratch.data());
      } else {
        linear_rows(args, 0, m, panels * part / parts * kLinearPanelCols,
                    std::min(n, panels * (part + 1) / parts * kLinearPanelCols), scratch.data());
      }
    }
  });
}

}  // namespace

at::Tensor project_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (linear_kernel_applies(x, weight, bias)) {
    at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
    run_linear_kernel(out, x, weight, bias);
    return out;
  }
  if (cpu::gemm_backend() == GemmBackend::openblas && x.dim() == 2 && weight.dim() == 2) {
    at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
    if (openblas_applies(out, x, weight, bias)) {
      openblas_project_into(out, x, weight, bias);
      return out;
    }
  }
  return project(x, weight, bias);
}

void project_into_cpu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  if (is_float(out) && unit_stride(out, 1) && linear_kernel_applies(x, weight, bias)) {
    run_linear_kernel(out, x, weight, bias);
  } else if (openblas_applies(out, x, weight, bias)) {
    openblas_project_into(out, x, weight, bias);
  } else {
    out.copy_(project(x, weight, bias));
  }
}

at::Tensor backend_mm(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_cpu() || a.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      b.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return a.mm(b);
  }
  return project_cpu(a, b.t(), std::nullopt);
}

}  // namespace attn_export::ops
