// Small dense products on row-major blocks, as the CPU attention kernel needs them.
//
// Below kBlasMinWork multiply-adds a plain loop wins: a BLAS call through ATen costs a few
// microseconds of dispatch, which would dominate the 10x10x16 blocks of short sequences.
// Above it, the block is wrapped (no copy) and handed to ATen's BLAS. The loops are written so
// that the compiler vectorizes them: contiguous inner loops and `omp simd` reductions.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace attn_export::ops::cpu {

constexpr int64_t kBlasMinWork = 32 * 32 * 32;

template <typename T>
at::Tensor wrap_block(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(
      const_cast<T*>(data), {rows, cols}, {ld, 1},
      at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

template <typename T>
void scale_rows(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    T* ci = c + i * ldc;
    if (beta == T(0)) {
      std::fill(ci, ci + n, T(0));
    } else if (beta != T(1)) {
      for (int64_t j = 0; j < n; ++j) ci[j] *= beta;
    }
  }
}

// C[m, n] = alpha * A[m, k] B[n, k]^T + beta * C
template <typename T>
void gemm_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    wrap_block(c, m, n, ldc).addmm_(wrap_block(a, m, k, lda), wrap_block(b, n, k, ldb).t(), beta, alpha);
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    const T* ai = a + i * lda;
    T* ci = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) {
      const T* bj = b + j * ldb;
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t p = 0; p < k; ++p) {
        acc += ai[p] * bj[p];
      }
      ci[j] = beta == T(0) ? alpha * acc : alpha * acc + beta * ci[j];
    }
  }
}

// C[m, n] = alpha * A[m, k] B[k, n] + beta * C
template <typename T>
void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    wrap_block(c, m, n, ldc).addmm_(wrap_block(a, m, k, lda), wrap_block(b, k, n, ldb), beta, alpha);
    return;
  }
  scale_rows(m, n, beta, c, ldc);
  for (int64_t i = 0; i < m; ++i) {
    T* ci = c + i * ldc;
    for (int64_t p = 0; p < k; ++p) {
      const T t = alpha * a[i * lda + p];
      const T* bp = b + p * ldb;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        ci[j] += t * bp[j];
      }
    }
  }
}

// C[m, n] = alpha * A[k, m]^T B[k, n] + beta * C
template <typename T>
void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    wrap_block(c, m, n, ldc).addmm_(wrap_block(a, k, m, lda).t(), wrap_block(b, k, n, ldb), beta, alpha);
    return;
  }
  scale_rows(m, n, beta, c, ldc);
  for (int64_t p = 0; p < k; ++p) {
    const T* bp = b + p * ldb;
    for (int64_t i = 0; i < m; ++i) {
      const T t = alpha * a[p * lda + i];
      T* ci = c + i * ldc;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        ci[j] += t * bp[j];
      }
    }
  }
}

}  // namespace attn_export::ops::cpu
