// The CPU kernels' host services (csrc/kernels/cpu/runtime.h) for the PyTorch extension:
// ATen's thread pool, and the GEMM library in force (csrc/kernels/cpu/gemm_backend.h): the BLAS
// that torch was built with, or OpenBLAS. This is the only place where the kernels of
// csrc/kernels/cpu/ meet ATen.
#include "../../kernels/cpu/runtime.h"

#include "../../kernels/cpu/gemm_backend.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace attn_export::cpu {
namespace {

// A row-major block as a tensor over the same memory (no copy).
template <typename T>
at::Tensor wrap_block(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// OpenBLAS always runs on one thread, inside at::parallel_for's tasks, never on its own pool:
// two pools on the same cores fight (OpenBLAS's workers spin and yield while ATen's OpenMP
// threads wait for work), 1.7 GFLOP/s at 128x384x128 with two threads each (docs/benchmarks.md).
// At top level the product is cut into one part per thread: the rows of C, or its columns.
template <typename T>
void openblas_gemm_split(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                         int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const int64_t threads = at::in_parallel_region()
                              ? 1
                              : std::clamp<int64_t>(m * n * k / kGemmMinWorkPerThread, 1, at::get_num_threads());
  if (threads == 1) {
    openblas_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  // Rows when there are at least as many as columns, else columns: each call packs the whole
  // of the operand that is not split, and the smaller one is the cheaper to repeat (32-128
  // tokens against 512-1536 features ran 1.0-2.1x faster split by columns; docs/benchmarks.md).
  const bool split_rows = m >= n;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      if (split_rows) {  // rows r0..r1 of op(A): rows of A, or columns of A when transposed
        const int64_t r0 = m * part / threads, r1 = m * (part + 1) / threads;
        if (r1 == r0) {
          continue;
        }
        openblas_gemm(trans_a, trans_b, r1 - r0, n, k, alpha, a + (trans_a ? r0 : r0 * lda), lda, b, ldb,
                      beta, c + r0 * ldc, ldc);
      } else {  // columns c0..c1 of op(B), in whole 16-column pieces where n allows
        const int64_t pieces = (n + 15) / 16;
        const int64_t c0 = std::min(n, pieces * part / threads * 16);
        const int64_t c1 = std::min(n, pieces * (part + 1) / threads * 16);
        if (c1 > c0) {
          openblas_gemm(trans_a, trans_b, m, c1 - c0, k, alpha, a, lda, b + (trans_b ? c0 * ldb : c0), ldb,
                        beta, c + c0, ldc);
        }
      }
    }
  });
}

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (gemm_backend() == GemmBackend::openblas) {
    openblas_gemm_split(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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
