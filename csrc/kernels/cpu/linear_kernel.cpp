// The projection kernel of linear_kernel.h: a BLIS-style register tile (AVX-512: 12 x 32, 24
// accumulators; each step of k loads two vectors of B and broadcasts twelve values of A;
// AVX2: 6 x 16, twice per panel), sweeping 32-column panels of B. A panel is copied into a contiguous k x 32 block before
// it is reused across row tiles: weight rows n floats apart map to few L1 sets (n = 384:
// eight), and the copy costs less than the conflict misses it avoids. Up to 16 token rows
// against a row-major weight take a dot-product loop instead (dot_rows), which packs nothing.
#include "linear_kernel.h"

#include "gemm_backend.h"
#include "isa_limit.h"

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

// The same tile loop compiled twice: 12 rows x two 16-float vectors (24 of AVX-512's 32
// registers), and, for AVX2 + FMA (16 registers), 6 rows x two 8-float vectors swept over the
// panel's two 16-column halves (12 accumulators, BLIS's Haswell shape). The helpers below have
// no target attribute and are always inlined: they take the ISA of the entry point.
#define ATTN_EXPORT_AVX512 __attribute__((target("arch=x86-64-v4")))
#define ATTN_EXPORT_AVX2 __attribute__((target("avx2,fma")))
#define ATTN_EXPORT_INLINE __attribute__((always_inline)) inline

namespace {

typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));

template <typename V>
ATTN_EXPORT_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
ATTN_EXPORT_INLINE void store(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// c[0:R, 0:2W] = bias (+ c) + a[0:R, 0:k] b[0:k, 0:2W] for W-float vectors V. The products
// accumulate in k order onto the bias, one fused multiply-add each, like BLAS with beta = 1
// over a bias-filled output.
template <typename V, int R>
ATTN_EXPORT_INLINE void tile(int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb,
                             const float* bias, float* c, int64_t ldc, bool accumulate) {
  constexpr int W = sizeof(V) / sizeof(float);
  V lo[R], hi[R];
  const V bias_lo = load<V>(bias), bias_hi = load<V>(bias + W);
  for (int r = 0; r < R; ++r) {
    lo[r] = accumulate ? bias_lo + load<V>(c + r * ldc) : bias_lo;
    hi[r] = accumulate ? bias_hi + load<V>(c + r * ldc + W) : bias_hi;
  }
  for (int64_t p = 0; p < k; ++p) {
    const V b_lo = load<V>(b + p * ldb), b_hi = load<V>(b + p * ldb + W);
    for (int r = 0; r < R; ++r) {
      const float s = a[r * lda + p];
      lo[r] += s * b_lo;
      hi[r] += s * b_hi;
    }
  }
  for (int r = 0; r < R; ++r) {
    store<V>(c + r * ldc, lo[r]);
    store<V>(c + r * ldc + W, hi[r]);
  }
}

// tile<V, rows> for 1 <= rows <= R, as a jump table of fully unrolled tiles, over the panel's
// 32 columns (one AVX-512 tile, or two AVX2 ones side by side).
template <typename V, int R>
ATTN_EXPORT_INLINE void tile_rows(int rows, int64_t k, const float* a, int64_t lda, const float* b,
                                  int64_t ldb, const float* bias, float* c, int64_t ldc, bool accumulate) {
  if constexpr (R > 0) {
    if (rows == R) {
      constexpr int64_t kTileCols = 2 * sizeof(V) / sizeof(float);
      for (int64_t j = 0; j < kPanelCols; j += kTileCols) {
        tile<V, R>(k, a, lda, b + j, ldb, bias + j, c + j, ldc, accumulate);
      }
    } else {
      tile_rows<V, R - 1>(rows, k, a, lda, b, ldb, bias, c, ldc, accumulate);
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
void pack_transposed_panel(const float* w, int64_t ldw, int64_t k, int64_t width, float* panel) {
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

// For a handful of token rows (decoding) and a row-major weight, C[i, j] = bias[j] (+ C) +
// dot(A[i, :], W[j, :]) with both read as they lie. Packing W^T panels costs k * n transposing
// copies per call, which at 8 tokens is several times the product itself (decode 8x1x256x8:
// most of the layer's time); here each weight row is read once per kDotRows rows of A and
// reduced along k in kDotRows x kDotCols vector accumulators (12: AVX2 has 16 registers). Rows
// or weight rows past the end are clamped to the last one, computed and dropped, so that the
// block stays one fully unrolled loop.
constexpr int kDotRows = 4, kDotCols = 3;

// The sum of a vector's lanes as a tree of half-width adds (log2 W dependent adds, where a
// lane-by-lane loop in order would chain W of them).
typedef float Vec4 __attribute__((vector_size(16)));

template <typename Half, typename V>
ATTN_EXPORT_INLINE Half fold(V v) {
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof(Half));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(Half), sizeof(Half));
  return lo + hi;
}

ATTN_EXPORT_INLINE float lane_sum(Vec4 v) {
  return (v[0] + v[2]) + (v[1] + v[3]);
}

ATTN_EXPORT_INLINE float lane_sum(Vec8 v) {
  return lane_sum(fold<Vec4>(v));
}

ATTN_EXPORT_INLINE float lane_sum(Vec16 v) {
  return lane_sum(fold<Vec8>(v));
}

template <typename V>
ATTN_EXPORT_INLINE void dot_rows(const LinearArgs& x, int64_t row_begin, int64_t row_end, int64_t col_begin,
                                 int64_t col_end) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  const int64_t k = x.k, k_vec = k - k % W;
  for (int64_t j0 = col_begin; j0 < col_end; j0 += kDotCols) {
    const float* w[kDotCols];
    for (int c = 0; c < kDotCols; ++c) {
      w[c] = x.b + std::min(j0 + c, col_end - 1) * x.ldb;
    }
    const int cols = static_cast<int>(std::min<int64_t>(kDotCols, col_end - j0));
    for (int64_t i0 = row_begin; i0 < row_end; i0 += kDotRows) {
      const float* a[kDotRows];
      for (int r = 0; r < kDotRows; ++r) {
        a[r] = x.a + std::min(i0 + r, row_end - 1) * x.lda;
      }
      V acc[kDotRows][kDotCols] = {};
      for (int64_t p = 0; p < k_vec; p += W) {
        V wv[kDotCols];
        for (int c = 0; c < kDotCols; ++c) {
          wv[c] = load<V>(w[c] + p);
        }
        for (int r = 0; r < kDotRows; ++r) {
          const V av = load<V>(a[r] + p);
          for (int c = 0; c < kDotCols; ++c) {
            acc[r][c] += av * wv[c];
          }
        }
      }
      const int rows = static_cast<int>(std::min<int64_t>(kDotRows, row_end - i0));
      for (int r = 0; r < rows; ++r) {
        float* out = x.c + (i0 + r) * x.ldc + j0;
        for (int c = 0; c < cols; ++c) {
          float sum = lane_sum(acc[r][c]);
          for (int64_t p = k_vec; p < k; ++p) {
            sum += a[r][p] * w[c][p];
          }
          const float base = (x.bias != nullptr ? x.bias[j0 + c] : 0.0f) + (x.accumulate ? out[c] : 0.0f);
          out[c] = base + sum;
        }
      }
    }
  }
}

// linear_rows with R-row tiles of V vectors.
template <typename V, int R>
ATTN_EXPORT_INLINE void rows(const LinearArgs& x, int64_t row_begin, int64_t row_end, int64_t col_begin,
                             int64_t col_end, float* scratch) {
  float* const panel = scratch;                                // k x 32, packed columns of B
  float* const panel_bias = panel + x.k * kPanelCols;          // 32
  float* const partial = panel_bias + kPanelCols;              // kTileRows x 32 output staging
  const int64_t row_count = row_end - row_begin;
  if (x.b_transposed && row_count <= kLinearDotMaxRows) {
    dot_rows<V>(x, row_begin, row_end, col_begin, col_end);
    return;
  }
  // A panel is reused by rows / R tiles; below two the copy does not pay, nor when its rows
  // already spread over the L1 sets.
  const bool pack_full_panels = row_count >= 2 * R && !rows_spread_over_l1_sets(x.ldb);
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
    for (int64_t i0 = row_begin; i0 < row_end; i0 += R) {
      const int tile_rows_here = static_cast<int>(std::min<int64_t>(R, row_end - i0));
      const float* a = x.a + i0 * x.lda;
      float* c = x.c + i0 * x.ldc + j0;
      if (width == kPanelCols) {
        tile_rows<V, R>(tile_rows_here, x.k, a, x.lda, b, ldb, bias, c, x.ldc, x.accumulate);
      } else {
        if (x.accumulate) {
          for (int r = 0; r < tile_rows_here; ++r) {
            std::copy(c + r * x.ldc, c + r * x.ldc + width, partial + r * kPanelCols);
          }
        }
        tile_rows<V, R>(tile_rows_here, x.k, a, x.lda, b, ldb, bias, partial, kPanelCols, x.accumulate);
        for (int r = 0; r < tile_rows_here; ++r) {
          std::memcpy(c + r * x.ldc, partial + r * kPanelCols, width * sizeof(float));
        }
      }
    }
  }
}

ATTN_EXPORT_AVX512 void rows_avx512(const LinearArgs& x, int64_t row_begin, int64_t row_end,
                                    int64_t col_begin, int64_t col_end, float* scratch) {
  rows<Vec16, kTileRows>(x, row_begin, row_end, col_begin, col_end, scratch);
}

ATTN_EXPORT_AVX2 void rows_avx2(const LinearArgs& x, int64_t row_begin, int64_t row_end, int64_t col_begin,
                                int64_t col_end, float* scratch) {
  rows<Vec8, kTileRows / 2>(x, row_begin, row_end, col_begin, col_end, scratch);
}

LinearKernelIsa detect_isa() {
  const IsaLevel limit = isa_limit();
  if (limit == IsaLevel::avx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512cd")) {
    return LinearKernelIsa::avx512;
  }
  if (limit != IsaLevel::generic && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return LinearKernelIsa::avx2;
  }
  return LinearKernelIsa::none;
}

}  // namespace

LinearKernelIsa linear_kernel_isa() {
  static const LinearKernelIsa isa = detect_isa();
  return isa;
}

bool linear_kernel_available() {
  return linear_kernel_isa() != LinearKernelIsa::none && gemm_microkernels_enabled();
}

int64_t linear_kernel_max_work() {
  static const bool amd_avx2 = [] {
    __builtin_cpu_init();
    return linear_kernel_isa() == LinearKernelIsa::avx2 && __builtin_cpu_is("amd");
  }();
  if (gemm_backend() == GemmBackend::openblas) {
    return int64_t{1} << 23;
  }
  return amd_avx2 ? int64_t{1} << 31 : int64_t{1} << 25;
}

void linear_rows(const LinearArgs& x, int64_t row_begin, int64_t row_end, int64_t col_begin, int64_t col_end,
                 float* scratch) {
  if (linear_kernel_isa() == LinearKernelIsa::avx512) {
    rows_avx512(x, row_begin, row_end, col_begin, col_end, scratch);
  } else {
    rows_avx2(x, row_begin, row_end, col_begin, col_end, scratch);
  }
}

#else  // no GCC x86-64: BLAS serves every projection

LinearKernelIsa linear_kernel_isa() {
  return LinearKernelIsa::none;
}

bool linear_kernel_available() {
  return false;
}

int64_t linear_kernel_max_work() {
  return 0;
}

void linear_rows(const LinearArgs&, int64_t, int64_t, int64_t, int64_t, float*) {}

#endif

}  // namespace attn_export::cpu

// For attn_export/ops/gemm.py (ctypes): 0 none, 1 AVX2 + FMA, 2 AVX-512.
extern "C" __attribute__((visibility("default"))) int attn_export_linear_kernel_isa() {
  return static_cast<int>(attn_export::cpu::linear_kernel_isa());
}

// For attn_export/ops/gemm.py: log2 of linear_kernel_max_work() (0 without the kernel).
extern "C" __attribute__((visibility("default"))) int attn_export_linear_kernel_max_work_log2() {
  const int64_t max_work = attn_export::cpu::linear_kernel_max_work();
  return max_work > 0 ? 63 - __builtin_clzll(static_cast<unsigned long long>(max_work)) : 0;
}
