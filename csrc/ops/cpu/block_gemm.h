// Small dense products on row-major blocks, as the CPU attention kernel needs them.
//
// Below kBlasMinWork multiply-adds the vectorized loops of row_kernels.h win: a BLAS call
// through ATen costs microseconds of dispatch, which would dominate the 16x16x32 blocks of
// short sequences. Above it, the block is wrapped (no copy) and handed to ATen's BLAS.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "row_kernels.h"
#include "vec_kernels.h"

namespace attn_export::ops::cpu {

constexpr int64_t kBlasMinWork = 64 * 64 * 64;

template <typename T>
at::Tensor wrap_block(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(
      const_cast<T*>(data), {rows, cols}, {ld, 1},
      at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// Scores S[m, 0:n] = alpha * A[m, k] B[n, k]^T into a row-padded buffer (ldc >=
// padded_cols(n)); columns [n, padded_cols(n)) are left for the caller to fill.
template <typename T>
void scores_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    wrap_block(c, m, n, ldc).addmm_(wrap_block(a, m, k, lda), wrap_block(b, n, k, ldb).t(), T(0), alpha);
  } else {
    vec::scores(m, n, k, alpha, a, lda, b, ldb, c, ldc);
  }
}

// C[m, n] = alpha * A[m, k] B[k, n] + beta * C
template <typename T>
void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    wrap_block(c, m, n, ldc).addmm_(wrap_block(a, m, k, lda), wrap_block(b, k, n, ldb), beta, alpha);
  } else {
    vec::gemm_nn(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// C[m, n] = alpha * A[k, m]^T B[k, n] + beta * C
template <typename T>
void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    wrap_block(c, m, n, ldc).addmm_(wrap_block(a, k, m, lda).t(), wrap_block(b, k, n, ldb), beta, alpha);
  } else {
    vec::gemm_tn(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

}  // namespace attn_export::ops::cpu
