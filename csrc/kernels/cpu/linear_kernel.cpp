// The projection kernel of linear_kernel.h: a BLIS-style 12 x 32 register tile (24 AVX-512
// accumulators; each step of k loads two vectors of B and broadcasts twelve values of A),
// sweeping 32-column panels of B. A panel is copied into a contiguous k x 32 block before
// it is reused across row tiles: weight rows n floats apart map to few L1 sets (n = 384:
// eight), and the copy costs less than the conflict misses it avoids.
#include "linear_kernel.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define ATTN_EXPORT_LINEAR_KERNEL 1
#endif

namespace attn_export::cpu {

constexpr int64_t kPanelCols = kLinearPanelCols;  // two 16-float vectors
constexpr int kTileRows = 12;

int64_t linear_scratch_floats(int64_t k) {
  return k * kPanelCols + kPanelCols + kTileRows * kPanelCols;
}

#if defined(ATTN_EXPORT_LINEAR_KERNEL)

#define ATTN_EXPORT_AVX512 __attribute__((target("arch=x86-64-v4")))

namespace {

typedef float Vec16 __attribute__((vector_size(64)));

ATTN_EXPORT_AVX512 inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

ATTN_EXPORT_AVX512 inline void store16(float* p, Vec16 v) {
  std::memcpy(p, &v, sizeof(v));
}

// c[0:R, 0:32] = bias (+ c) + a[0:R, 0:k] b[0:k, 0:32]. The products accumulate in k order
// onto the bias, one fused multiply-add each, like BLAS with beta = 1 over a bias-filled output.
template <int R>
ATTN_EXPORT_AVX512 __attribute__((always_inline)) inline void tile(
    int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, const float* bias,
    float* c, int64_t ldc, bool accumulate) {
  Vec16 lo[R], hi[R];
  const Vec16 bias_lo = load16(bias), bias_hi = load16(bias + 16);
  for (int r = 0; r < R; ++r) {
    lo[r] = accumulate ? bias_lo + load16(c + r * ldc) : bias_lo;
    hi[r] = accumulate ? bias_hi + load16(c + r * ldc + 16) : bias_hi;
  }
  for (int64_t p = 0; p < k; ++p) {
    const Vec16 b_lo = load16(b + p * ldb), b_hi = load16(b + p * ldb + 16);
    for (int r = 0; r < R; ++r) {
      const float s = a[r * lda + p];
      lo[r] += s * b_lo;
      hi[r] += s * b_hi;
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(c + r * ldc, lo[r]);
    store16(c + r * ldc + 16, hi[r]);
  }
}

// tile<rows> for 1 <= rows <= kTileRows, as a jump table of fully unrolled tiles.
template <int R = kTileRows>
ATTN_EXPORT_AVX512 __attribute__((always_inline)) inline void tile_rows(
    int rows, int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
    const float* bias, float* c, int64_t ldc, bool accumulate) {
  if constexpr (R > 0) {
    if (rows == R) {
      tile<R>(k, a, lda, b, ldb, bias, c, ldc, accumulate);
    } else {
      tile_rows<R - 1>(rows, k, a, lda, b, ldb, bias, c, ldc, accumulate);
    }
  }
}

// Whether rows `ld` floats apart fall into at least half of the 64 sets of a 48 KiB 12-way L1
// (64-byte lines): a row stride of L lines visits 64 / gcd(L, 64) sets.
bool rows_spread_over_l1_sets(int64_t ld) {
  const int64_t bytes = ld * static_cast<int64_t>(sizeof(float));
  return bytes % 64 != 0 || std::gcd(bytes / 64, int64_t{64}) <= 2;
}

// panel[p, j] = w[j, p] for the `width` rows of a row-major weight w (rows ldw apart), zero
// beyond them: the k x 32 block of B = W^T that the tiles read. A row-major weight (the
// layout of nn.Linear, which FSDP and every optimizer expect of a parameter) costs this one
// transposing copy per panel, in place of the plain copy a column-major one takes.
ATTN_EXPORT_AVX512 void pack_transposed_panel(const float* w, int64_t ldw, int64_t k, int64_t width,
                                              float* panel) {
  if (width < kPanelCols) {
    std::fill(panel, panel + k * kPanelCols, 0.0f);
  }
  for (int64_t j = 0; j < width; ++j) {
    const float* row = w + j * ldw;
    for (int64_t p = 0; p < k; ++p) {
      panel[p * kPanelCols + j] = row[p];
    }
  }
}

}  // namespace

bool linear_kernel_available() {
  static const bool available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                                __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("avx512cd");
  return available;
}

ATTN_EXPORT_AVX512 void linear_rows(const LinearArgs& x, int64_t row_begin, int64_t row_end,
                                    int64_t col_begin, int64_t col_end, float* scratch) {
  float* const panel = scratch;                                // k x 32, packed columns of B
  float* const panel_bias = panel + x.k * kPanelCols;          // 32
  float* const partial = panel_bias + kPanelCols;              // kTileRows x 32 output staging
  const int64_t rows = row_end - row_begin;
  // A panel is reused by rows / kTileRows tiles; below two the copy does not pay, nor when
  // its rows already spread over the L1 sets.
  const bool pack_full_panels = rows >= 2 * kTileRows && !rows_spread_over_l1_sets(x.ldb);
  for (int64_t j0 = col_begin; j0 < col_end; j0 += kPanelCols) {
    const int64_t width = std::min(kPanelCols, col_end - j0);
    const float* b = x.b + j0;
    int64_t ldb = x.ldb;
    const float* bias = panel_bias;
    if (x.b_transposed) {
      pack_transposed_panel(x.b + j0 * x.ldb, x.ldb, x.k, width, panel);
      b = panel;
      ldb = kPanelCols;
    } else if (width < kPanelCols || pack_full_panels) {
      // The last, narrower panel is zero-padded to a full one so that every load is a full
      // vector; its extra columns are computed and dropped.
      for (int64_t p = 0; p < x.k; ++p) {
        float* dst = panel + p * kPanelCols;
        std::fill(std::copy(b + p * ldb, b + p * ldb + width, dst), dst + kPanelCols, 0.0f);
      }
      b = panel;
      ldb = kPanelCols;
    }
    if (x.bias != nullptr) {
      std::fill(std::copy(x.bias + j0, x.bias + j0 + width, panel_bias), panel_bias + kPanelCols, 0.0f);
    } else {
      std::fill(panel_bias, panel_bias + kPanelCols, 0.0f);
    }
    for (int64_t i0 = row_begin; i0 < row_end; i0 += kTileRows) {
      const int tile_rows_here = static_cast<int>(std::min<int64_t>(kTileRows, row_end - i0));
      const float* a = x.a + i0 * x.lda;
      float* c = x.c + i0 * x.ldc + j0;
      if (width == kPanelCols) {
        tile_rows(tile_rows_here, x.k, a, x.lda, b, ldb, bias, c, x.ldc, x.accumulate);
      } else {
        if (x.accumulate) {
          for (int r = 0; r < tile_rows_here; ++r) {
            std::copy(c + r * x.ldc, c + r * x.ldc + width, partial + r * kPanelCols);
          }
        }
        tile_rows(tile_rows_here, x.k, a, x.lda, b, ldb, bias, partial, kPanelCols, x.accumulate);
        for (int r = 0; r < tile_rows_here; ++r) {
          std::memcpy(c + r * x.ldc, partial + r * kPanelCols, width * sizeof(float));
        }
      }
    }
  }
}

#else  // no GCC x86-64: BLAS serves every projection

bool linear_kernel_available() {
  return false;
}

void linear_rows(const LinearArgs&, int64_t, int64_t, int64_t, int64_t, float*) {}

#endif

}  // namespace attn_export::cpu
