// Small dense products on row-major blocks, as the CPU attention kernel needs them.
//
// Below kBlasMinWork multiply-adds the vectorized loops of row_kernels.h win: a BLAS call
// through the host (runtime.h: ATen in the extension) costs microseconds of dispatch, which would dominate the 16x16x32 blocks of
// short sequences. Above it, float32 blocks go to the register-tiled kernel of
// linear_kernel.h where the CPU has AVX-512 (the inner dimension of QK^T is a head dim, and
// BLAS spends a third of such a product packing its operands); other blocks go to the host's
// BLAS (runtime.h's blas_gemm).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear_kernel.h"
#include "row_kernels.h"
#include "runtime.h"
#include "vec_kernels.h"

namespace attn_export::cpu {

constexpr int64_t kBlasMinWork = 64 * 64 * 64;

template <typename T>
bool use_linear_kernel() {
  return std::is_same_v<T, float> && linear_kernel_available();
}

inline float* linear_scratch(int64_t k) {
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(linear_scratch_floats(k)));
  return scratch.data();
}

// c[:m, :n] = a[:m, :k] b[:k, :n] on the calling thread (float32; unit column strides);
// accumulate: c += a b.
inline void linear_block(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                         int64_t ldb, float* c, int64_t ldc, bool accumulate = false) {
  linear_rows(LinearArgs{m, n, k, a, lda, b, ldb, nullptr, c, ldc, accumulate}, 0, m, 0, n, linear_scratch(k));
}

// b_t[p, j] = alpha * b[j, p] for j < n, p < k (b_t row-major [k, n]): the B^T of A B^T in
// the layout linear_kernel.h reads, the scale folded in on the way.
inline void transpose_scaled(int64_t n, int64_t k, float alpha, const float* b, int64_t ldb, float* b_t) {
  // In chunks of 64 rows of b, whose cache lines stay in L1 across the k passes.
  for (int64_t j0 = 0; j0 < n; j0 += 64) {
    const int64_t j1 = std::min(n, j0 + 64);
    for (int64_t p = 0; p < k; ++p) {
      float* out = b_t + p * n;
      for (int64_t j = j0; j < j1; ++j) {
        out[j] = alpha * b[j * ldb + p];
      }
    }
  }
}

// Whether an m x n x k product of T goes to linear_kernel.h.
template <typename T>
bool product_uses_linear_kernel(int64_t m, int64_t n, int64_t k) {
  return m * n * k >= kBlasMinWork && use_linear_kernel<T>();
}

// Scores S[m, 0:n] = alpha * A[m, k] B[n, k]^T into a row-padded buffer (ldc >=
// padded_cols(n)); columns [n, padded_cols(n)) are left for the caller to fill.
template <typename T>
void scores_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    blas_gemm(false, true, m, n, k, alpha, a, lda, b, ldb, T(0), c, ldc);
  } else {
    vec::scores(m, n, k, alpha, a, lda, b, ldb, c, ldc);
  }
}

// scores_nt with alpha * B^T already at hand (b_t: row-major [k, >= n], rows ldb_t apart, as
// transpose_scaled writes it, once per head: see HeadTransposed in attention_cpu.cpp): the
// tiled kernel's way into A B^T. b_t == nullptr: scores_nt (small-block loops or BLAS).
template <typename T>
void scores_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, T* c, int64_t ldc, const float* b_t, int64_t ldb_t) {
  if constexpr (std::is_same_v<T, float>) {
    if (b_t != nullptr) {
      linear_block(m, n, k, a, lda, b_t, ldb_t, c, ldc);
      return;
    }
  }
  scores_nt<T>(m, n, k, alpha, a, lda, b, ldb, c, ldc);
}

// C[m, n] = alpha * A[m, k] B[k, n] + beta * C
template <typename T>
void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if (product_uses_linear_kernel<T>(m, n, k) && alpha == T(1) && beta == T(0)) {
    linear_block(m, n, k, reinterpret_cast<const float*>(a), lda, reinterpret_cast<const float*>(b), ldb,
                 reinterpret_cast<float*>(c), ldc);
  } else if (m * n * k >= kBlasMinWork) {
    blas_gemm(false, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    vec::gemm_nn(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// C[m, n] = alpha * A[k, m]^T B[k, n] + beta * C
template <typename T>
void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m * n * k >= kBlasMinWork) {
    blas_gemm(true, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    vec::gemm_tn(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

}  // namespace attn_export::cpu
