#include "projection.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../multi_head_attention.h"
#include "../../kernels/cpu/linear_kernel.h"

namespace attn_export::ops {
namespace {

using cpu::kLinearPanelCols;
using cpu::linear_kernel_available;
using cpu::linear_rows;
using cpu::linear_scratch_floats;
using cpu::LinearArgs;

// Above this many multiply-adds per projection BLAS is at its best (its packing and threads
// pay for themselves), and it takes over.
constexpr int64_t kLinearKernelMaxWork = int64_t{1} << 25;
// Below this many per thread, a second thread costs more to wake than it saves.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 17;

bool unit_stride(const at::Tensor& t, int64_t dim) {
  return t.stride(dim) == 1 || t.size(dim) <= 1;
}

bool is_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat;
}

bool linear_kernel_applies(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return is_float(x) && is_float(weight) && x.dim() == 2 && weight.dim() == 2 &&
         unit_stride(x, 1) && (unit_stride(weight, 0) || unit_stride(weight, 1)) &&
         (!bias.has_value() || (is_float(*bias) && unit_stride(*bias, 0))) &&
         x.size(0) * weight.size(0) * weight.size(1) <= kLinearKernelMaxWork && linear_kernel_available();
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
  const int64_t threads = std::clamp<int64_t>(work / kMinWorkPerThread, 1, at::get_num_threads());
  // Token rows are split when each thread gets a few; a handful of tokens (decoding) splits
  // the weight's column panels instead.
  const bool split_rows = m >= 8 * threads;
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
  if (!linear_kernel_applies(x, weight, bias)) {
    return project(x, weight, bias);
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  run_linear_kernel(out, x, weight, bias);
  return out;
}

void project_into_cpu(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  if (!(is_float(out) && unit_stride(out, 1) && linear_kernel_applies(x, weight, bias))) {
    out.copy_(project(x, weight, bias));
    return;
  }
  run_linear_kernel(out, x, weight, bias);
}

}  // namespace attn_export::ops
