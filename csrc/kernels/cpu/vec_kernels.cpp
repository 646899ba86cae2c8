// One definition per row kernel and dtype, cloned per instruction set. GCC's target_clones
// emits an AVX-512, an AVX2+FMA and a baseline version of each function plus a resolver that
// picks one when the library loads; the force-inlined loops of row_kernels.h are compiled
// into every clone. Elsewhere (other compilers, other CPUs) there is one baseline version.
#include "vec_kernels.h"

#include <vector>

#include "row_kernels.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define ATTN_EXPORT_MULTIVERSION \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ATTN_EXPORT_MULTIVERSION
#endif

namespace attn_export::cpu::vec {

// A . B^T as dot products needs one horizontal reduction per output element; with B
// transposed (and its columns zero-padded to the score rows' padding) the inner loop becomes
// a full-vector FMA across a row of outputs. The transpose costs n*k, worth it once a few
// rows of A share it.
constexpr int64_t kMinRowsToTranspose = 4;

// Per-thread scratch for the padded last column panel of a product.
template <typename T>
T* panel_for(int64_t k) {
  thread_local std::vector<T> panel;
  panel.resize(static_cast<size_t>(k * rows::Vec<T>::kWidth));
  return panel.data();
}

#define ATTN_EXPORT_DEFINE_ROW_KERNELS(T)                                                           \
  ATTN_EXPORT_MULTIVERSION void gemm_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a,      \
                                        int64_t lda, const T* b, int64_t ldb, T beta, T* c,         \
                                        int64_t ldc) {                                              \
    rows::gemm_nt<T>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);                                 \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void scores(int64_t m, int64_t n, int64_t k, T alpha, const T* a,       \
                                       int64_t lda, const T* b, int64_t ldb, T* c, int64_t ldc) {   \
    if (m < kMinRowsToTranspose) {                                                                  \
      rows::gemm_nt<T>(m, n, k, alpha, a, lda, b, ldb, T(0), c, ldc);                               \
      return;                                                                                       \
    }                                                                                               \
    const int64_t n_padded = rows::padded_cols(n);                                                  \
    thread_local std::vector<T> b_t;                                                                \
    b_t.assign(static_cast<size_t>(n_padded * k), T(0));                                            \
    rows::transpose<T>(n, k, b, ldb, b_t.data(), n_padded);                                         \
    rows::gemm_nn<T>(m, n_padded, k, alpha, a, lda, b_t.data(), n_padded, T(0), c, ldc,             \
                     panel_for<T>(k));                                                              \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a,      \
                                        int64_t lda, const T* b, int64_t ldb, T beta, T* c,         \
                                        int64_t ldc) {                                              \
    rows::gemm_nn<T>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, panel_for<T>(k));                \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a,      \
                                        int64_t lda, const T* b, int64_t ldb, T beta, T* c,         \
                                        int64_t ldc) {                                              \
    rows::gemm_tn<T>(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, panel_for<T>(k));                \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void scale_rows(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {      \
    rows::scale_rows<T>(m, n, beta, c, ldc);                                                        \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void softmax_rows(T* x, int64_t rows, int64_t n, int64_t ld, T* lse,     \
                                             T* row_scale) {                                        \
    rows::softmax_rows<T>(x, rows, n, ld, lse, row_scale);                                          \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void probabilities_row(T* x, int64_t n, T lse) {                        \
    rows::probabilities_row<T>(x, n, lse);                                                          \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void softmax_backward_row(const T* p, T* dp, int64_t n) {               \
    rows::softmax_backward_row<T>(p, dp, n);                                                        \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void apply_bool_mask_row(const uint8_t* mask, int64_t stride, T* x,     \
                                                    int64_t n) {                                    \
    rows::apply_bool_mask_row<T>(mask, stride, x, n);                                               \
  }                                                                                                 \
  ATTN_EXPORT_MULTIVERSION void add_mask_row(const T* mask, int64_t stride, T* x, int64_t n) {     \
    rows::add_mask_row<T>(mask, stride, x, n);                                                      \
  }

ATTN_EXPORT_DEFINE_ROW_KERNELS(float)
ATTN_EXPORT_DEFINE_ROW_KERNELS(double)

}  // namespace attn_export::cpu::vec
