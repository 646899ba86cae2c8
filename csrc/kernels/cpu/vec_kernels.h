// Entry points to the vectorized row kernels (row_kernels.h), compiled once per instruction
// set and picked at load time by the CPU's features (GCC function multiversioning), so one
// binary uses AVX-512 where it exists and still runs on a baseline x86-64 CPU.
#pragma once

#include <cstdint>

namespace attn_export::cpu::vec {

// scores(): c[:, 0:n] = alpha * a b^T for a row-padded score buffer (ldc >= padded_cols(n),
// see row_kernels.h); columns [n, padded_cols(n)) are left unspecified for the caller to fill.

#define ATTN_EXPORT_DECLARE_ROW_KERNELS(T)                                                      \
  void gemm_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, \
               int64_t ldb, T beta, T* c, int64_t ldc);                                       \
  void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, \
               int64_t ldb, T beta, T* c, int64_t ldc);                                       \
  void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b, \
               int64_t ldb, T beta, T* c, int64_t ldc);                                       \
  void scale_rows(int64_t m, int64_t n, T beta, T* c, int64_t ldc);                           \
  void scores(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,  \
              int64_t ldb, T* c, int64_t ldc);                                                \
  void softmax_rows(T* x, int64_t rows, int64_t n, int64_t ld, T* lse, T* row_scale);         \
  void probabilities_row(T* x, int64_t n, T lse);                                             \
  void softmax_backward_row(const T* p, T* dp, int64_t n);                                    \
  void apply_bool_mask_row(const uint8_t* mask, int64_t stride, T* x, int64_t n);             \
  void add_mask_row(const T* mask, int64_t stride, T* x, int64_t n);

ATTN_EXPORT_DECLARE_ROW_KERNELS(float)
ATTN_EXPORT_DECLARE_ROW_KERNELS(double)

#undef ATTN_EXPORT_DECLARE_ROW_KERNELS

}  // namespace attn_export::cpu::vec
