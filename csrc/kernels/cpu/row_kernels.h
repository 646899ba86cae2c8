// The innermost loops of the CPU attention kernels, written so the compiler vectorizes them:
// contiguous inner loops, `omp simd` reductions, no calls (see exp.h). They are templates
// instantiated in vec_kernels.cpp once per instruction set (AVX-512, AVX2, baseline), which
// is why everything here is force-inlined and free of ATen.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "exp.h"

#if defined(__GNUC__)
#define ATTN_EXPORT_INLINE inline __attribute__((always_inline))
#else
#define ATTN_EXPORT_INLINE inline
#endif

namespace attn_export::cpu::rows {

// c[i, j] = alpha * a[i, :] . b[j, :]   (i < m, j < n, reduction over k)
template <typename T>
ATTN_EXPORT_INLINE void gemm_nt(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                                const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
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

// dst[p, j] = src[j, p] for j < n, p < k (dst row stride ld_dst)
template <typename T>
ATTN_EXPORT_INLINE void transpose(int64_t n, int64_t k, const T* src, int64_t ld_src, T* dst,
                                  int64_t ld_dst) {
  // Inner loop over j: a strided gather per output row, which vectorizes (AVX-512/AVX2).
  for (int64_t p = 0; p < k; ++p) {
    T* out = dst + p * ld_dst;
    const T* col = src + p;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      out[j] = col[j * ld_src];
    }
  }
}

template <typename T>
ATTN_EXPORT_INLINE void scale_rows(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {
  if (beta == T(1)) {
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    T* ci = c + i * ldc;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      ci[j] = beta == T(0) ? T(0) : ci[j] * beta;
    }
  }
}

// A register-blocked product for the blocks of short sequences. GCC vector extensions keep
// it ISA-neutral: a 64-byte vector is one AVX-512 register, two AVX2 registers or four SSE
// registers, whichever the enclosing clone (vec_kernels.cpp) targets.
template <typename T>
struct Vec {
  static constexpr int kWidth = 64 / sizeof(T);
  typedef T type __attribute__((vector_size(64)));
};

// c[r, 0:nr] = alpha * sum_p a(r, p) b[p, 0:W] + beta * c[r, 0:nr] for r < MR, where
// a(r, p) = a[r * a_row + p * a_col]: one MR x W tile, accumulated in registers. b must have
// W readable columns (the caller pads the last, narrower panel).
template <typename T, int MR>
ATTN_EXPORT_INLINE void tile_nn(int64_t nr, int64_t k, T alpha, const T* a, int64_t a_row,
                                int64_t a_col, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  using V = typename Vec<T>::type;
  V acc[MR];
  for (int r = 0; r < MR; ++r) {
    acc[r] = V{};
  }
  for (int64_t p = 0; p < k; ++p) {
    V bv;
    std::memcpy(&bv, b + p * ldb, sizeof(V));
    for (int r = 0; r < MR; ++r) {
      acc[r] += a[r * a_row + p * a_col] * bv;
    }
  }
  for (int r = 0; r < MR; ++r) {
    T* cr = c + r * ldc;
    if (nr == Vec<T>::kWidth) {
      V out = alpha * acc[r];
      if (beta != T(0)) {
        V old;
        std::memcpy(&old, cr, sizeof(V));
        out += beta * old;
      }
      std::memcpy(cr, &out, sizeof(V));
    } else {
      for (int64_t j = 0; j < nr; ++j) {
        cr[j] = beta == T(0) ? alpha * acc[r][j] : alpha * acc[r][j] + beta * cr[j];
      }
    }
  }
}

template <typename T>
ATTN_EXPORT_INLINE void gemm_strided_a(int64_t m, int64_t n, int64_t k, T alpha, const T* a,
                                       int64_t a_row, int64_t a_col, const T* b, int64_t ldb,
                                       T beta, T* c, int64_t ldc, T* panel) {
  constexpr int W = Vec<T>::kWidth;
  constexpr int MR = 4;
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const int64_t nr = std::min<int64_t>(W, n - j0);
    const T* bj = b + j0;
    int64_t ld = ldb;
    if (nr < W) {  // pad the narrow last panel so that every load is a full vector
      for (int64_t p = 0; p < k; ++p) {
        std::fill(std::copy(b + p * ldb + j0, b + p * ldb + n, panel + p * W), panel + (p + 1) * W, T(0));
      }
      bj = panel;
      ld = W;
    }
    for (int64_t i0 = 0; i0 < m; i0 += MR) {
      const T* ai = a + i0 * a_row;
      T* ci = c + i0 * ldc + j0;
      switch (std::min<int64_t>(MR, m - i0)) {
        case 4: tile_nn<T, 4>(nr, k, alpha, ai, a_row, a_col, bj, ld, beta, ci, ldc); break;
        case 3: tile_nn<T, 3>(nr, k, alpha, ai, a_row, a_col, bj, ld, beta, ci, ldc); break;
        case 2: tile_nn<T, 2>(nr, k, alpha, ai, a_row, a_col, bj, ld, beta, ci, ldc); break;
        default: tile_nn<T, 1>(nr, k, alpha, ai, a_row, a_col, bj, ld, beta, ci, ldc); break;
      }
    }
  }
}

// c[i, :] = alpha * sum_p a[i, p] b[p, :] + beta * c[i, :]; panel: k x Vec<T>::kWidth scratch
template <typename T>
ATTN_EXPORT_INLINE void gemm_nn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                                const T* b, int64_t ldb, T beta, T* c, int64_t ldc, T* panel) {
  gemm_strided_a(m, n, k, alpha, a, lda, int64_t{1}, b, ldb, beta, c, ldc, panel);
}

// c[i, :] = alpha * sum_p a[p, i] b[p, :] + beta * c[i, :]
template <typename T>
ATTN_EXPORT_INLINE void gemm_tn(int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
                                const T* b, int64_t ldb, T beta, T* c, int64_t ldc, T* panel) {
  gemm_strided_a(m, n, k, alpha, a, int64_t{1}, lda, b, ldb, beta, c, ldc, panel);
}

// Rows of scores live in buffers whose row stride is padded_cols(n), a multiple of the vector
// width, with the padding holding -inf (scores) or 0 (probabilities, gradients): a float row
// of 10 keys then costs one full-vector pass instead of a scalar epilogue, the common case
// for short sequences. float64 rows take plain loops: they are the reference/gradcheck path.
constexpr int64_t kRowAlign = 16;

constexpr int64_t padded_cols(int64_t n) {
  return (n + kRowAlign - 1) / kRowAlign * kRowAlign;
}

using VecF = Vec<float>::type;
typedef int32_t VecI __attribute__((vector_size(64)));
constexpr int kWidthF = Vec<float>::kWidth;
static_assert(kRowAlign % kWidthF == 0, "row padding must hold whole float vectors");

ATTN_EXPORT_INLINE VecF splat(float x) {
  return VecF{} + x;
}

ATTN_EXPORT_INLINE VecF load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

ATTN_EXPORT_INLINE void store(float* p, VecF v) {
  std::memcpy(p, &v, sizeof(v));
}

// Horizontal reductions as a tree of halvings (16 -> 8 -> 4 lanes, then scalars): a chain of
// 15 dependent scalar operations per row would cost more than the row's exponentials.
typedef float VecF8 __attribute__((vector_size(32)));
typedef float VecF4 __attribute__((vector_size(16)));

template <typename Op>
ATTN_EXPORT_INLINE float reduce(VecF v, Op op) {
  VecF8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(lo8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(lo8), sizeof(hi8));
  const VecF8 v8 = op(lo8, hi8);
  VecF4 lo4, hi4;
  std::memcpy(&lo4, &v8, sizeof(lo4));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&v8) + sizeof(lo4), sizeof(hi4));
  const VecF4 v4 = op(lo4, hi4);
  return op(op(v4[0], v4[1]), op(v4[2], v4[3]));
}

ATTN_EXPORT_INLINE float reduce_max(VecF v) {
  return reduce(v, [](auto a, auto b) { return a > b ? a : b; });
}

ATTN_EXPORT_INLINE float reduce_sum(VecF v) {
  return reduce(v, [](auto a, auto b) { return a + b; });
}

// exp_approx (exp.h) on a whole float vector V of any width (VI: int32 lanes of the same
// count), for the softmax's arguments x - max and x - lse: x <= 88 (no upper clamp), -inf -> 0,
// NaN -> NaN. Round-to-nearest through the 1.5 * 2^23 trick, since vector extensions have no
// floor; that sum's low mantissa bits are n itself, so 2^n is built without a conversion.
// 16 vector operations per vector, 6 of them the polynomial (25 with Cephes' degree-7 one):
// the exponentials are a tenth of the flash forward's time.
template <typename V, typename VI>
ATTN_EXPORT_INLINE V exp_approx_vector(V x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const VI underflow = x < -87.0f;       // false for NaN, which passes through
  x = underflow ? V{} - 87.0f : x;
  const V t = x * 1.44269504088896341f + kRound;
  const V n = t - kRound;
  const V r = x - n * kLn2Hi - n * kLn2Lo;
  V p = V{} + kExpPoly[0];
  for (int i = 1; i < kExpPolyTerms; ++i) {
    p = p * r + kExpPoly[i];
  }
  VI bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits + (127 - kRoundBits)) << 23;  // (n + 127) << 23
  V two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return underflow ? V{} : p * two_n;
}

ATTN_EXPORT_INLINE VecF exp_approx(VecF x) {
  return exp_approx_vector<VecF, VecI>(x);
}

// In-place softmax of one row; returns its log-sum-exp. A row with no finite score (all keys
// masked) becomes zeros with lse = -inf instead of the 0/0 = NaN of a naive softmax.
template <typename T>
ATTN_EXPORT_INLINE T softmax_row(T* x, int64_t n) {  // float64 rows; float rows: softmax_rows<float>
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  T max = kNegInf;
  for (int64_t j = 0; j < n; ++j) {
    max = x[j] > max ? x[j] : max;
  }
  if (max == kNegInf) {
    std::fill(x, x + n, T(0));
    return max;
  }
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = cpu::exp_approx(x[j] - max);
    sum += x[j];
  }
  const T inv = T(1) / sum;
  for (int64_t j = 0; j < n; ++j) {
    x[j] *= inv;
  }
  return max + std::log(sum);
}

// softmax_row over `rows` rows ld apart, log-sum-exps into lse. The float version works in
// passes over a group of rows (maxima, exponentials, logarithms, scaling) so that the rows'
// dependency chains (a horizontal reduction, a log, a division each) overlap instead of
// running one after another: on the 16-key rows of short sequences those chains dominate.
//
// With row_scale given, the rows are left unnormalized (exp(x - max)) and row_scale[r] gets
// the factor 1 / sum (0 for a row with no visible key): the caller scales the product P V
// instead, Dv values per row rather than Lk, which spares a pass over long rows.
template <typename T>
ATTN_EXPORT_INLINE void softmax_rows(T* x, int64_t rows, int64_t n, int64_t ld, T* lse, T* row_scale) {
  for (int64_t r = 0; r < rows; ++r) {
    lse[r] = softmax_row(x + r * ld, n);
    if (row_scale != nullptr) {
      row_scale[r] = T(1);
    }
  }
}

template <>
ATTN_EXPORT_INLINE void softmax_rows<float>(float* x, int64_t rows, int64_t n, int64_t ld, float* lse,
                                            float* row_scale) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr int64_t kGroup = 16;
  const int64_t end = padded_cols(n);
  float max[kGroup], sum[kGroup];
  for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
    const int64_t count = std::min(kGroup, rows - r0);
    float* base = x + r0 * ld;
    for (int64_t r = 0; r < count; ++r) {
      VecF vmax = splat(kNegInf);
      for (int64_t j = 0; j < end; j += kWidthF) {
        const VecF v = load(base + r * ld + j);
        vmax = v > vmax ? v : vmax;
      }
      max[r] = reduce_max(vmax);
    }
    for (int64_t r = 0; r < count; ++r) {
      // A row with no finite score (all keys masked) subtracts 0 instead of -inf: its
      // exponentials are exp(-inf) = 0 and it is caught below by its maximum.
      const float shift = max[r] == kNegInf ? 0.0f : max[r];
      VecF vsum = splat(0.0f);
      for (int64_t j = 0; j < end; j += kWidthF) {
        const VecF e = exp_approx(load(base + r * ld + j) - shift);
        vsum += e;
        store(base + r * ld + j, e);
      }
      sum[r] = reduce_sum(vsum);
    }
    for (int64_t r = 0; r < count; ++r) {
      lse[r0 + r] = max[r] == kNegInf ? kNegInf : max[r] + std::log(sum[r]);
      sum[r] = max[r] == kNegInf ? 0.0f : 1.0f / sum[r];
    }
    if (row_scale != nullptr) {
      std::copy(sum, sum + count, row_scale + r0);
      continue;
    }
    for (int64_t r = 0; r < count; ++r) {
      const float inv = sum[r];
      for (int64_t j = 0; j < end; j += kWidthF) {
        store(base + r * ld + j, load(base + r * ld + j) * inv);
      }
    }
  }
}

// Probabilities recomputed from scores and the forward's log-sum-exp.
template <typename T>
ATTN_EXPORT_INLINE void probabilities_row(T* x, int64_t n, T lse) {
  if (lse == -std::numeric_limits<T>::infinity()) {
    std::fill(x, x + n, T(0));
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    x[j] = cpu::exp_approx(x[j] - lse);
  }
}

template <>
ATTN_EXPORT_INLINE void probabilities_row<float>(float* x, int64_t n, float lse) {
  const int64_t end = padded_cols(n);
  if (lse == -std::numeric_limits<float>::infinity()) {
    std::fill(x, x + end, 0.0f);
    return;
  }
  for (int64_t j = 0; j < end; j += kWidthF) {
    store(x + j, exp_approx(load(x + j) - lse));
  }
}

// Softmax backward for one row: dp <- p * (dp - sum(p * dp)).
template <typename T>
ATTN_EXPORT_INLINE void softmax_backward_row(const T* p, T* dp, int64_t n) {
  T dot = 0;
  for (int64_t j = 0; j < n; ++j) {
    dot += p[j] * dp[j];
  }
  for (int64_t j = 0; j < n; ++j) {
    dp[j] = p[j] * (dp[j] - dot);
  }
}

// p and dp hold padded_cols(n) values, the padding 0.
template <>
ATTN_EXPORT_INLINE void softmax_backward_row<float>(const float* p, float* dp, int64_t n) {
  const int64_t end = padded_cols(n);
  VecF vdot = splat(0.0f);
  for (int64_t j = 0; j < end; j += kWidthF) {
    vdot += load(p + j) * load(dp + j);
  }
  const float dot = reduce_sum(vdot);
  for (int64_t j = 0; j < end; j += kWidthF) {
    store(dp + j, load(p + j) * (load(dp + j) - dot));
  }
}

// Masks on one row of scores: a boolean mask sets -inf where true, an additive one is added.
template <typename T>
ATTN_EXPORT_INLINE void apply_bool_mask_row(const uint8_t* mask, int64_t stride, T* x, int64_t n) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  if (stride == 1) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      x[j] = mask[j] ? kNegInf : x[j];
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      x[j] = mask[j * stride] ? kNegInf : x[j];
    }
  }
}

template <typename T>
ATTN_EXPORT_INLINE void add_mask_row(const T* mask, int64_t stride, T* x, int64_t n) {
  if (stride == 1) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      x[j] += mask[j];
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      x[j] += mask[j * stride];
    }
  }
}

}  // namespace attn_export::cpu::rows
