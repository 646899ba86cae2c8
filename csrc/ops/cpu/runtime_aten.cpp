// The CPU kernels' host services (csrc/kernels/cpu/runtime.h) for the PyTorch extension:
// ATen's thread pool, and the GEMM library in force (csrc/kernels/cpu/gemm_backend.h): the BLAS
// that torch was built with, or OpenBLAS. This is the only place where the kernels of
// csrc/kernels/cpu/ meet ATen.
#include "../../kernels/cpu/runtime.h"

#include "../../kernels/cpu/gemm_backend.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

namespace attn_export::cpu {
namespace {

// A row-major block as a tensor over the same memory (no copy).
template <typename T>
at::Tensor wrap_block(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (gemm_backend() == GemmBackend::openblas) {
    // Inside a parallel_for task the kernels' threads are busy: one OpenBLAS thread each.
    const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    openblas_gemm(threads, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  const at::Tensor a_op = trans_a ? wrap_block(a, k, m, lda).t() : wrap_block(a, m, k, lda);
  const at::Tensor b_op = trans_b ? wrap_block(b, n, k, ldb).t() : wrap_block(b, k, n, ldb);
  wrap_block(c, m, n, ldc).addmm_(a_op, b_op, beta, alpha);
}

}  // namespace

int64_t num_threads() {
  return at::get_num_threads();
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(begin, end, grain, fn);
}

void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace attn_export::cpu
