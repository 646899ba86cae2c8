// The flash-style CPU attention core (flash_cpu.h).
//
// Forward: one task per (batch, head, block of kQueryBlock query rows). The task walks the
// visible keys in blocks of kKeyBlock: S = scale * Q K^T for the block (K packed transposed, a
// register-tiled product), soft-cap, masks, then the online softmax (running max m, running sum
// l, the output accumulator rescaled by exp(m_old - m_new)) and O += P V. Blocks that causality
// hides are never visited; blocks that the boolean masks hide entirely are skipped; on the
// blocks that straddle the causal diagonal, forward and backward, the products skip the
// register tiles causality hides (Visible).
//
// Backward: one task per (batch, head, key block), so that a task owns its rows of dK and dV
// and accumulates them in its scratch without synchronization. For each query block that sees
// the key block it recomputes P = exp(S - lse) and forms dV += P^T dO, dP = dO V^T,
// dS = P * (dP - D) with D = rowsum(dO * O), dK += scale dS^T Q and dQ += scale dS K. dQ sums
// over key blocks, which different threads own: each chunk of tasks accumulates into its own
// dQ buffer and one pass sums the buffers into grad_q.
//
// The products are the register tiles below, written with GCC vector extensions and compiled
// per instruction set (AVX-512, AVX2+FMA, baseline) through target attributes; which runs is
// chosen once from the CPU's features (isa()). float64 (the reference/gradcheck path) runs the
// same code with baseline vectors and exact exponentials.
#include "flash_cpu.h"
#include "isa_limit.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "alibi.h"
#include "row_kernels.h"
#include "runtime.h"
#include "vec_kernels.h"

namespace attn_export::cpu::flash {
namespace {

// Query rows per forward task and per backward step: Q's block (64 x 64 floats, 16 KiB) and
// the scores (64 x 128, 32 KiB) stay in L1/L2 while the key block is walked.
constexpr int64_t kQueryBlock = 64;
// Keys per block: K^T and V of a block at head dim 64 are 32 KiB each, within L2 next to the
// scores; long enough rows for the softmax's vector passes to amortize their reductions.
constexpr int64_t kKeyBlock = 128;
// Column padding that suits every instruction set's tile width: the per-thread buffers are sized
// with it. The loops pad the keys only to their own tile width (Tiles::pad): at 16 keys the
// AVX2 kernels would otherwise compute twice the scores they need.
constexpr int64_t kPad = 32;

int64_t padded(int64_t n) {
  return (n + kPad - 1) / kPad * kPad;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// A tile configuration: W lanes of T per vector, MR rows x NV vectors of accumulators.
template <typename T, int W_, int MR_, int NV_, bool Fma_ = false>
struct Tiles {
  using Scalar = T;
  static constexpr bool kFma = Fma_;  // whether the products' multiply-adds are fused
  static constexpr int W = W_, MR = MR_, NV = NV_, NR = W_ * NV_;
  typedef T V __attribute__((vector_size(W_ * sizeof(T))));
  static_assert(kPad % NR == 0, "the padding must hold whole tiles");
  // n rounded up to whole column panels.
  static int64_t pad(int64_t n) { return (n + NR - 1) / NR * NR; }
};

// c[r, 0:NR] (+)= alpha * sum_p a(r, p) b[p, 0:NR] for r < R, a(r, p) = a[r * ar + p * ac]:
// one tile, accumulated in registers over the inner dimension k.
template <typename C, int R>
ATTN_EXPORT_INLINE void tile(int64_t k, typename C::Scalar alpha, const typename C::Scalar* a, int64_t ar,
                             int64_t ac, const typename C::Scalar* b, int64_t ldb, typename C::Scalar* c,
                             int64_t ldc, bool accumulate) {
  using T = typename C::Scalar;
  using V = typename C::V;
  V acc[R][C::NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < C::NV; ++v) {
      acc[r][v] = V{};
    }
  }
  for (int64_t p = 0; p < k; ++p) {
    V bv[C::NV];
    for (int v = 0; v < C::NV; ++v) {
      std::memcpy(&bv[v], b + p * ldb + v * C::W, sizeof(V));
    }
    for (int r = 0; r < R; ++r) {
      const T x = a[r * ar + p * ac];
      for (int v = 0; v < C::NV; ++v) {
        acc[r][v] += x * bv[v];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < C::NV; ++v) {
      T* out = c + r * ldc + v * C::W;
      V value = alpha * acc[r][v];
      if (accumulate) {
        V old;
        std::memcpy(&old, out, sizeof(V));
        value += old;
      }
      std::memcpy(out, &value, sizeof(V));
    }
  }
}

// The last `rows` (< MR) rows of a column panel: the tile of exactly that height.
template <typename C, int R>
ATTN_EXPORT_INLINE void tail_tile(int64_t rows, int64_t k, typename C::Scalar alpha, const typename C::Scalar* a,
                                  int64_t ar, int64_t ac, const typename C::Scalar* b, int64_t ldb,
                                  typename C::Scalar* c, int64_t ldc, bool accumulate) {
  if constexpr (R > 0) {
    if (rows == R) {
      tile<C, R>(k, alpha, a, ar, ac, b, ldb, c, ldc, accumulate);
    } else {
      tail_tile<C, R - 1>(rows, k, alpha, a, ar, ac, b, ldb, c, ldc, accumulate);
    }
  }
}

// Which terms of a product causality leaves nonzero, at register-tile granularity, so that the
// blocks on the diagonal skip the hidden half instead of computing it and masking it away.
// offset = (the key at the product's key index 0) - (the query at its query index 0); query i
// sees key j when key j <= query i.
struct Visible {
  enum Kind {
    kAll,
    // rows are queries, columns keys (S = Q K^T, dP = dO V^T): a tile whose last row sees
    // none of a column panel is not computed; the caller masks those scores anyway.
    kColumnsToRow,
    // rows are queries, the inner dimension keys (O += P V, dQ += dS K): each tile stops at the
    // last key its last row sees (P and dS are 0 past it).
    kInnerToRow,
    // rows are keys, the inner dimension queries (dV += P^T dO, dK += dS^T Q): each tile starts
    // at the first query that sees its first key.
    kInnerFromRow,
  };
  Kind kind = kAll;
  int64_t offset = 0;
};

// The Visible of a product between query rows from row0 and keys from j0: all of it without
// causality, else key j visible to query i when j - causal_shift() <= i.
inline Visible causal_visible(const AttentionParams& p, Visible::Kind kind, int64_t row0, int64_t j0) {
  return p.is_causal ? Visible{kind, j0 - p.causal_shift() - row0} : Visible{};
}

// The tile of product()'s rows [i, i + rows) (rows = R, or rows < MR = R + 1 for the tail)
// against its column panel j, over the inner indices that `visible` leaves.
template <typename C, int R>
ATTN_EXPORT_INLINE void visible_tile(int64_t rows, int64_t i, int64_t j, int64_t k, typename C::Scalar alpha,
                                     const typename C::Scalar* a, int64_t ar, int64_t ac,
                                     const typename C::Scalar* panel, typename C::Scalar* c, int64_t ldc,
                                     bool accumulate, Visible visible) {
  int64_t lo = 0, hi = k;
  if (visible.kind == Visible::kColumnsToRow && j + visible.offset > i + rows - 1) {
    return;
  } else if (visible.kind == Visible::kInnerToRow) {
    hi = std::clamp<int64_t>(i + rows - visible.offset, 0, k);
  } else if (visible.kind == Visible::kInnerFromRow) {
    lo = std::clamp<int64_t>(i + visible.offset, 0, k);
  }
  if (hi <= lo && accumulate) {
    return;
  }
  a += i * ar + lo * ac;
  panel += lo * C::NR;
  c += i * ldc + j;
  if constexpr (R == C::MR) {
    tile<C, R>(hi - lo, alpha, a, ar, ac, panel, C::NR, c, ldc, accumulate);
  } else {
    tail_tile<C, R>(rows, hi - lo, alpha, a, ar, ac, panel, C::NR, c, ldc, accumulate);
  }
}

// C[m, 0:n] (+)= alpha * A B with a(i, p) = a[i * ar + p * ac] (A or, with ar = 1, A^T read
// from a row-major buffer), n a multiple of NR, and B packed in column panels of NR
// (pack_panels): panel q holds columns [q NR, q NR + NR), its rows NR apart, panels
// `panel_stride` apart. `visible` restricts the work to the terms causality leaves.
template <typename C>
ATTN_EXPORT_INLINE void product(int64_t m, int64_t n, int64_t k, typename C::Scalar alpha,
                                const typename C::Scalar* a, int64_t ar, int64_t ac, const typename C::Scalar* b,
                                int64_t panel_stride, typename C::Scalar* c, int64_t ldc, bool accumulate,
                                Visible visible = {}) {
  // Column panels outside: a panel of B (k x NR, contiguous) stays in L1 while the rows of A
  // stream by. Contiguous panels matter: rows of B a power of two apart (a head's K^T, or 128
  // keys) map to a handful of cache sets and evict one another.
  for (int64_t j = 0; j < n; j += C::NR) {
    const typename C::Scalar* panel = b + j / C::NR * panel_stride;
    int64_t i = 0;
    if (visible.kind == Visible::kAll) {  // all but the diagonal blocks: no checks per tile
      for (; i + C::MR <= m; i += C::MR) {
        tile<C, C::MR>(k, alpha, a + i * ar, ar, ac, panel, C::NR, c + i * ldc + j, ldc, accumulate);
      }
      tail_tile<C, C::MR - 1>(m - i, k, alpha, a + i * ar, ar, ac, panel, C::NR, c + i * ldc + j, ldc, accumulate);
      continue;
    }
    for (; i + C::MR <= m; i += C::MR) {
      visible_tile<C, C::MR>(C::MR, i, j, k, alpha, a, ar, ac, panel, c, ldc, accumulate, visible);
    }
    if (i < m) {
      visible_tile<C, C::MR - 1>(m - i, i, j, k, alpha, a, ar, ac, panel, c, ldc, accumulate, visible);
    }
  }
}

// B[p, j] = src[p * k_stride + j * n_stride] for p < k, j < n (zero for j in [n, n_pad)), packed
// in column panels of NR for product(): dst[q * k_total * NR + p * NR + jj], column j = q NR + jj.
// k_total >= k leaves room for rows packed later (a head's V, key block by key block).
template <typename C>
ATTN_EXPORT_INLINE void pack_panels(int64_t k, int64_t k_total, int64_t n, int64_t n_pad,
                                    const typename C::Scalar* src, int64_t k_stride, int64_t n_stride,
                                    typename C::Scalar* dst) {
  using T = typename C::Scalar;
  if (n_stride == 1) {
    // Rows contiguous along the columns (V in the forward; Q, dO and K in the backward): each
    // row goes out in whole NR-wide pieces. The element-by-element loop below reads such a
    // source down its columns, a row stride apart, and cost the backward an eighth of its time
    // repacking Q and dO for every key block.
    for (int64_t p = 0; p < k; ++p) {
      const T* in = src + p * k_stride;
      for (int64_t j0 = 0; j0 < n_pad; j0 += C::NR) {
        T* out = dst + j0 / C::NR * k_total * C::NR + p * C::NR;
        const int64_t width = std::clamp<int64_t>(n - j0, 0, C::NR);
        if (width == C::NR) {
          std::memcpy(out, in + j0, C::NR * sizeof(T));
        } else {
          std::copy(in + j0, in + j0 + width, out);
          std::fill(out + width, out + C::NR, T(0));
        }
      }
    }
    return;
  }
  int64_t j = 0;
  if (k_stride == 1) {
    // Rows contiguous along k (K^T: each key's row of head_dim values): 4 x 4 blocks moved
    // through registers, four loads and four stores where the loop below takes sixteen of
    // each. At 16 keys this packing was a quarter of the forward.
    typedef T V4 __attribute__((vector_size(4 * sizeof(T))));
    static_assert(C::NR % 4 == 0, "four keys from a multiple of 4 lie in one panel");
    for (; j + 4 <= n; j += 4) {
      T* out = dst + j / C::NR * k_total * C::NR + j % C::NR;
      const T* in = src + j * n_stride;
      int64_t p = 0;
      for (; p + 4 <= k; p += 4) {
        V4 r0, r1, r2, r3;
        std::memcpy(&r0, in + p, sizeof(V4));
        std::memcpy(&r1, in + n_stride + p, sizeof(V4));
        std::memcpy(&r2, in + 2 * n_stride + p, sizeof(V4));
        std::memcpy(&r3, in + 3 * n_stride + p, sizeof(V4));
        const V4 t0 = __builtin_shufflevector(r0, r1, 0, 4, 1, 5), t1 = __builtin_shufflevector(r0, r1, 2, 6, 3, 7);
        const V4 t2 = __builtin_shufflevector(r2, r3, 0, 4, 1, 5), t3 = __builtin_shufflevector(r2, r3, 2, 6, 3, 7);
        const V4 c0 = __builtin_shufflevector(t0, t2, 0, 1, 4, 5), c1 = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
        const V4 c2 = __builtin_shufflevector(t1, t3, 0, 1, 4, 5), c3 = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
        std::memcpy(out + p * C::NR, &c0, sizeof(V4));
        std::memcpy(out + (p + 1) * C::NR, &c1, sizeof(V4));
        std::memcpy(out + (p + 2) * C::NR, &c2, sizeof(V4));
        std::memcpy(out + (p + 3) * C::NR, &c3, sizeof(V4));
      }
      for (; p < k; ++p) {
        for (int64_t jj = 0; jj < 4; ++jj) {
          out[p * C::NR + jj] = in[jj * n_stride + p];
        }
      }
    }
  }
  for (; j < n_pad; ++j) {
    T* out = dst + j / C::NR * k_total * C::NR + j % C::NR;
    if (j < n) {
      const T* in = src + j * n_stride;
      for (int64_t p = 0; p < k; ++p) {
        out[p * C::NR] = in[p * k_stride];
      }
    } else {
      for (int64_t p = 0; p < k; ++p) {
        out[p * C::NR] = T(0);
      }
    }
  }
}

template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

// Whether the boolean masks (and causality) leave no key of [j0, j0 + cols) visible to any of
// the query rows [row0, row0 + rows). Exits at the first visible key: cheap for the blocks that
// are computed, and a skipped block saves its products. Additive masks are not inspected.
inline bool block_hidden(const AttentionParams& p, int64_t b, int64_t h, int64_t row0, int64_t rows, int64_t j0,
                         int64_t cols) {
  const AttentionMask& am = p.attn_mask;
  const AttentionMask& kpm = p.key_padding_mask;
  const bool am_bool = am.present() && am.kind == MaskKind::kBool;
  const bool kpm_bool = kpm.present() && kpm.kind == MaskKind::kBool;
  if (!am_bool && !kpm_bool) {
    return false;
  }
  const auto* am_ptr = static_cast<const uint8_t*>(am.ptr);
  const auto* kpm_ptr = static_cast<const uint8_t*>(kpm.ptr);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = row0 + r;
    const int64_t end = p.is_causal ? std::min(cols, p.causal_key_end(i) - j0) : cols;
    for (int64_t j = 0; j < end; ++j) {
      const bool hidden =
          (am_bool && am_ptr[b * am.batch_stride + h * am.head_stride + i * am.row_stride + (j0 + j) * am.col_stride]) ||
          (kpm_bool && kpm_ptr[b * kpm.batch_stride + (j0 + j) * kpm.col_stride]);
      if (!hidden) {
        return false;
      }
    }
  }
  return true;
}

// Scores of query rows [row0, row0 + rows) against keys [j0, j0 + cols) (s: rows ld apart, ld
// >= cols_pad), after the products: soft-cap, then ALiBi's bias, the masks, causality and -inf
// padding.
// raw, when given, receives the uncapped scaled scores (the soft-cap's derivative needs them).
template <typename T>
ATTN_EXPORT_INLINE void finish_scores(const AttentionParams& p, int64_t b, int64_t h, int64_t row0, int64_t rows,
                                      int64_t j0, int64_t cols, int64_t cols_pad, T* s, int64_t ld, T* raw) {
  const AttentionMask& am = p.attn_mask;
  const AttentionMask& kpm = p.key_padding_mask;
  const T cap = static_cast<T>(p.softcap), inv_cap = p.softcap > 0 ? T(1) / cap : T(0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = row0 + r;
    T* row = s + r * ld;
    if (p.softcap > 0) {  // before the masks: a -inf mask still removes the key
      if (raw != nullptr) {
        std::copy(row, row + cols, raw + r * ld);
      }
      for (int64_t j = 0; j < cols; ++j) {
        row[j] = cap * std::tanh(row[j] * inv_cap);
      }
    }
    add_alibi(p, h, i, j0, cols, row);  // finite: a -inf mask below still removes the key
    std::fill(row + cols, row + cols_pad, kNegInf<T>);
    if (am.present()) {
      const int64_t offset = b * am.batch_stride + h * am.head_stride + i * am.row_stride + j0 * am.col_stride;
      if (am.kind == MaskKind::kBool) {
        vec::apply_bool_mask_row(static_cast<const uint8_t*>(am.ptr) + offset, am.col_stride, row, cols);
      } else {
        vec::add_mask_row(static_cast<const T*>(am.ptr) + offset, am.col_stride, row, cols);
      }
    }
    if (kpm.present()) {
      const int64_t offset = b * kpm.batch_stride + j0 * kpm.col_stride;
      if (kpm.kind == MaskKind::kBool) {
        vec::apply_bool_mask_row(static_cast<const uint8_t*>(kpm.ptr) + offset, kpm.col_stride, row, cols);
      } else {
        vec::add_mask_row(static_cast<const T*>(kpm.ptr) + offset, kpm.col_stride, row, cols);
      }
    }
    if (p.is_causal && j0 + cols > p.causal_key_end(i)) {
      std::fill(row + std::max<int64_t>(0, p.causal_key_end(i) - j0), row + cols, kNegInf<T>);
    }
    if (p.is_causal && p.causal_key_begin(i) > j0) {  // the keys before the sliding window
      std::fill(row, row + std::min(cols, p.causal_key_begin(i) - j0), kNegInf<T>);
    }
  }
}

// The first key block (a multiple of kKeyBlock) that query rows from row0 on can see: the block of
// row0's sliding-window start, 0 without a window. The blocks before it are never visited.
inline int64_t first_key_block(const AttentionParams& p, int64_t row0) {
  return p.is_causal ? p.causal_key_begin(row0) / kKeyBlock * kKeyBlock : 0;
}

// One past the last query row that sees a key before key_end under the sliding window (rows
// after it see only later keys); seqlen_q without a window.
inline int64_t window_rows_end(const AttentionParams& p, int64_t key_end) {
  if (!p.is_causal || p.window <= 0) {
    return p.seqlen_q;
  }
  // Row i sees key j when j >= i + 1 + shift - window: the last row for j = key_end - 1.
  return std::clamp<int64_t>(key_end - 1 + p.window - p.causal_shift(), 0, p.seqlen_q);
}

// exp_approx on a vector of the tile width: the softmax passes run in the registers the
// products use (a 64-byte vector in an AVX2 function goes through the stack).
template <typename C>
ATTN_EXPORT_INLINE typename C::V exp_vector(typename C::V x) {
  typedef int32_t VI __attribute__((vector_size(C::W * sizeof(int32_t))));
  return rows::exp_approx_vector<typename C::V, VI>(x);
}

// Row maximum over n (a multiple of NR) values.
template <typename C>
ATTN_EXPORT_INLINE typename C::Scalar row_max(const typename C::Scalar* x, int64_t n) {
  using T = typename C::Scalar;
  using V = typename C::V;
  V vmax = V{} + kNegInf<T>;
  for (int64_t j = 0; j < n; j += C::W) {
    V v;
    std::memcpy(&v, x + j, sizeof(V));
    vmax = v > vmax ? v : vmax;
  }
  T m = vmax[0];
  for (int i = 1; i < C::W; ++i) {
    m = vmax[i] > m ? vmax[i] : m;
  }
  return m;
}

// x = exp(x - shift) over n (a multiple of NR) values; returns their sum. -inf becomes 0.
template <typename C>
ATTN_EXPORT_INLINE typename C::Scalar exp_shifted(typename C::Scalar* x, int64_t n, typename C::Scalar shift) {
  using T = typename C::Scalar;
  using V = typename C::V;
  if constexpr (std::is_same_v<T, float>) {
    V vsum = V{};
    for (int64_t j = 0; j < n; j += C::W) {
      V v;
      std::memcpy(&v, x + j, sizeof(V));
      v = exp_vector<C>(v - shift);
      std::memcpy(x + j, &v, sizeof(V));
      vsum += v;
    }
    T sum = 0;
    for (int i = 0; i < C::W; ++i) {
      sum += vsum[i];
    }
    return sum;
  } else {
    T sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      x[j] = std::exp(x[j] - shift);
      sum += x[j];
    }
    return sum;
  }
}

// x = exp(x) over n values (any n).
template <typename C>
ATTN_EXPORT_INLINE void exp_in_place(typename C::Scalar* x, int64_t n) {
  using T = typename C::Scalar;
  using V = typename C::V;
  int64_t j = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; j + C::W <= n; j += C::W) {
      V v;
      std::memcpy(&v, x + j, sizeof(V));
      v = exp_vector<C>(v);
      std::memcpy(x + j, &v, sizeof(V));
    }
  }
  for (; j < n; ++j) {
    x[j] = exp_approx(x[j]);
  }
}

// Per-thread buffers of the forward.
// K^T and V are packed once per head: a chunk's consecutive tasks are the query blocks of one
// head, and repacking per block costs as much as a third of the block's products.
template <typename T>
struct ForwardScratch {
  std::vector<T> k_t, v, s, o, m, l, m_new, alpha;
  int64_t head = -1;  // whose K^T and V k_t and v hold
  ForwardScratch(const AttentionParams& p)
      : k_t(p.head_dim * padded(p.seqlen_k)),
        v(padded(p.seqlen_k) * padded(p.head_dim_v)),
        s(std::min(kQueryBlock, p.seqlen_q) * kKeyBlock),
        o(std::min(kQueryBlock, p.seqlen_q) * padded(p.head_dim_v)),
        m(kQueryBlock),
        l(kQueryBlock),
        m_new(kQueryBlock),
        alpha(kQueryBlock) {}
};

// One forward task: query rows [row0, row0 + rows) of head (b, h).
template <typename C>
ATTN_EXPORT_INLINE void forward_block(const AttentionParams& p, int64_t b, int64_t h, int64_t row0, int64_t rows,
                                      ForwardScratch<typename C::Scalar>& w) {
  using T = typename C::Scalar;
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v, dv_pad = padded(dim_v);
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + row0 * p.q_row_stride;
  const int64_t kv = p.kv_head(h);
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + kv * p.k_head_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + kv * p.v_head_stride;
  T *s = w.s.data(), *o = w.o.data(), *m = w.m.data(), *l = w.l.data();
  std::fill(o, o + rows * dv_pad, T(0));
  std::fill(m, m + rows, kNegInf<T>);
  std::fill(l, l + rows, T(0));
  const int64_t keys_pad = C::pad(p.seqlen_k);
  if (w.head != b * p.num_heads + kv) {  // the query heads of a group share one packing
    pack_panels<C>(dim, dim, p.seqlen_k, keys_pad, k, 1, p.k_row_stride, w.k_t.data());
    pack_panels<C>(p.seqlen_k, keys_pad, dim_v, dv_pad, v, p.v_row_stride, 1, w.v.data());
    w.head = b * p.num_heads + kv;
  }
  // Causality: the block's last row sees keys [0, key_end), its other rows fewer; the sliding
  // window hides the blocks before its first row's window.
  const int64_t key_end = p.is_causal ? p.causal_key_end(row0 + rows - 1) : p.seqlen_k;
  for (int64_t j0 = first_key_block(p, row0); j0 < key_end; j0 += kKeyBlock) {
    const int64_t cols = std::min(kKeyBlock, key_end - j0), cols_pad = C::pad(cols);
    if (block_hidden(p, b, h, row0, rows, j0, cols)) {
      continue;
    }
    // Only the diagonal block has hidden terms: its tiles above the diagonal are skipped.
    const auto visible = [&](Visible::Kind kind) { return causal_visible(p, kind, row0, j0); };
    // Columns [cols, cols_pad) are zero padding or keys past a causal end: -inf below either way,
    // like the scores of the tiles skipped.
    product<C>(rows, cols_pad, dim, static_cast<T>(p.scale), q, p.q_row_stride, 1, w.k_t.data() + j0 * dim,
               dim * C::NR, s, kKeyBlock, false, visible(Visible::kColumnsToRow));
    finish_scores<T>(p, b, h, row0, rows, j0, cols, cols_pad, s, kKeyBlock, nullptr);
    // The online softmax in passes over the block's rows rather than row by row: the rows'
    // reductions overlap, and the rescaling is branch-free (a data-dependent branch on whether
    // a row's maximum grew mispredicted often), its factors exp(m_old - m_new) vectorized.
    T *m_new = w.m_new.data(), *alpha = w.alpha.data();
    for (int64_t r = 0; r < rows; ++r) {
      m_new[r] = std::max(m[r], row_max<C>(s + r * kKeyBlock, cols_pad));
      // A row with nothing visible yet keeps its empty state: alpha = exp(0) = 1.
      alpha[r] = m_new[r] == kNegInf<T> ? T(0) : m[r] - m_new[r];
    }
    exp_in_place<C>(alpha, rows);
    for (int64_t r = 0; r < rows; ++r) {
      T* row = s + r * kKeyBlock;
      T* acc = o + r * dv_pad;
      if (m_new[r] == kNegInf<T>) {  // P = 0
        std::fill(row, row + cols_pad, T(0));
        continue;
      }
      const T sum = exp_shifted<C>(row, cols_pad, m_new[r]);
      for (int64_t d = 0; d < dv_pad; ++d) {
        acc[d] *= alpha[r];
      }
      l[r] = l[r] * alpha[r] + sum;
      m[r] = m_new[r];
    }
    // P is 0 past cols: the product stops there.
    product<C>(rows, dv_pad, cols, T(1), s, kKeyBlock, 1, w.v.data() + j0 * C::NR, keys_pad * C::NR, o, dv_pad, true,
               visible(Visible::kInnerToRow));
  }
  T* out = static_cast<T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride + row0 * p.out_row_stride;
  T* lse = static_cast<T*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q + row0;
  for (int64_t r = 0; r < rows; ++r) {
    // A row with no visible key: output 0 and lse = -inf, never 0/0.
    const bool empty = l[r] == T(0);
    const T inv = empty ? T(0) : T(1) / l[r];
    for (int64_t d = 0; d < dim_v; ++d) {
      out[r * p.out_row_stride + d] = o[r * dv_pad + d] * inv;
    }
    lse[r] = empty ? kNegInf<T> : m[r] + std::log(l[r]);
  }
}

template <typename C>
ATTN_EXPORT_INLINE void forward_tasks(const AttentionParams& p, int64_t begin, int64_t end) {
  ForwardScratch<typename C::Scalar> w(p);
  const int64_t blocks = ceil_div(p.seqlen_q, kQueryBlock);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t bh = t / blocks, row0 = (t % blocks) * kQueryBlock;
    forward_block<C>(p, bh / p.num_heads, bh % p.num_heads, row0, std::min(kQueryBlock, p.seqlen_q - row0), w);
  }
}

// Per-thread buffers of the backward.
template <typename T>
struct BackwardScratch {
  std::vector<T> k_t, v_t, k, q, dout, s, raw, dp, dk, dv;
  // Sized by the blocks this call can have, not by the largest: short sequences (a batch of
  // 16-token heads) zeroed 128-key buffers on every call.
  BackwardScratch(const AttentionParams& p)
      : BackwardScratch(p, padded(std::min(kKeyBlock, p.seqlen_k)), std::min(kQueryBlock, p.seqlen_q)) {}
  BackwardScratch(const AttentionParams& p, int64_t keys, int64_t rows)
      : k_t(p.head_dim * keys),
        v_t(p.head_dim_v * keys),
        k(keys * padded(p.head_dim)),
        q(rows * padded(p.head_dim)),
        dout(rows * padded(p.head_dim_v)),
        s(rows * kKeyBlock),
        raw(p.softcap > 0 ? rows * kKeyBlock : 0),
        dp(rows * kKeyBlock),
        dk(keys * padded(p.head_dim)),
        dv(keys * padded(p.head_dim_v)) {}
};

// One backward task: keys [j0, j0 + cols) of head (b, h); dQ accumulates into dq (rows
// padded(head_dim) apart, the head's [seqlen_q, *] slice of this chunk's buffer). d_row: the
// head's rowsum(dO * O).
template <typename C>
ATTN_EXPORT_INLINE void backward_block(const AttentionBackwardParams& p, int64_t b, int64_t h, int64_t j0,
                                       int64_t cols, const typename C::Scalar* d_row, typename C::Scalar* dq,
                                       BackwardScratch<typename C::Scalar>& w) {
  using T = typename C::Scalar;
  const int64_t dim = p.head_dim, dim_v = p.head_dim_v, d_pad = padded(dim), dv_pad = padded(dim_v);
  const int64_t cols_pad = C::pad(cols);
  const T scale = static_cast<T>(p.scale);
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const int64_t kv = p.kv_head(h);
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + kv * p.k_head_stride + j0 * p.k_row_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + kv * p.v_head_stride + j0 * p.v_row_stride;
  const T* dout = static_cast<const T*>(p.grad_out) + b * p.grad_out_batch_stride + h * p.grad_out_head_stride;
  const T* lse = static_cast<const T*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
  T *s = w.s.data(), *dp = w.dp.data(), *dk = w.dk.data(), *dv = w.dv.data();
  T* raw = p.softcap > 0 ? w.raw.data() : nullptr;
  pack_panels<C>(dim, dim, cols, cols_pad, k, 1, p.k_row_stride, w.k_t.data());
  pack_panels<C>(dim_v, dim_v, cols, cols_pad, v, 1, p.v_row_stride, w.v_t.data());
  pack_panels<C>(cols, cols_pad, dim, d_pad, k, p.k_row_stride, 1, w.k.data());
  std::fill(dk, dk + cols_pad * d_pad, T(0));
  std::fill(dv, dv + cols_pad * dv_pad, T(0));
  const T inv_cap = p.softcap > 0 ? T(1) / static_cast<T>(p.softcap) : T(0);

  // Causality: rows before j0 - causal_shift() see none of these keys.
  // The sliding window: rows from window_rows_end on see only later keys.
  const int64_t first_row = p.is_causal ? std::max<int64_t>(0, j0 - p.causal_shift()) : 0;
  const int64_t rows_end = window_rows_end(p, j0 + cols);
  for (int64_t row0 = first_row / kQueryBlock * kQueryBlock; row0 < rows_end; row0 += kQueryBlock) {
    const int64_t rows = std::min(kQueryBlock, p.seqlen_q - row0);
    if (block_hidden(p, b, h, row0, rows, j0, cols)) {
      continue;
    }
    const T* q_blk = q + row0 * p.q_row_stride;
    const T* dout_blk = dout + row0 * p.grad_out_row_stride;
    // The blocks on the diagonal skip their hidden terms (product's Visible); the scores and
    // dS there are set below (-inf, 0), never left to the skipped tiles.
    const auto visible = [&](Visible::Kind kind) { return causal_visible(p, kind, row0, j0); };
    product<C>(rows, cols_pad, dim, scale, q_blk, p.q_row_stride, 1, w.k_t.data(), dim * C::NR, s, kKeyBlock, false,
               visible(Visible::kColumnsToRow));
    finish_scores<T>(p, b, h, row0, rows, j0, cols, cols_pad, s, kKeyBlock, raw);
    for (int64_t r = 0; r < rows; ++r) {
      // P = exp(S - lse); a row with no visible key (lse = -inf) has P = 0.
      T* row = s + r * kKeyBlock;
      if (lse[row0 + r] == kNegInf<T>) {
        std::fill(row, row + cols_pad, T(0));
      } else {
        exp_shifted<C>(row, cols_pad, lse[row0 + r]);
      }
    }
    pack_panels<C>(rows, rows, dim_v, dv_pad, dout_blk, p.grad_out_row_stride, 1, w.dout.data());
    // dV += P^T dO
    product<C>(cols_pad, dv_pad, rows, T(1), s, 1, kKeyBlock, w.dout.data(), rows * C::NR, dv, dv_pad, true,
               visible(Visible::kInnerFromRow));
    // dP = dO V^T, then dS = P * (dP - D) (times the soft-cap's derivative 1 - tanh^2)
    product<C>(rows, cols_pad, dim_v, T(1), dout_blk, p.grad_out_row_stride, 1, w.v_t.data(), dim_v * C::NR, dp,
               kKeyBlock, false, visible(Visible::kColumnsToRow));
    for (int64_t r = 0; r < rows; ++r) {
      const T* prob = s + r * kKeyBlock;
      T* ds = dp + r * kKeyBlock;
      const T d = d_row[row0 + r];
      // The keys causality hides from this row: dS = 0 there, whatever the skipped tiles left.
      const int64_t end = p.is_causal ? std::clamp<int64_t>(p.causal_key_end(row0 + r) - j0, 0, cols_pad) : cols_pad;
#pragma omp simd
      for (int64_t j = 0; j < end; ++j) {
        ds[j] = prob[j] * (ds[j] - d);
      }
      std::fill(ds + end, ds + cols_pad, T(0));
      if (raw != nullptr) {
        // Masked keys have P = 0, hence dS = 0, and x finite there (no mask is added to it).
        const T* x = raw + r * kKeyBlock;
        for (int64_t j = 0; j < std::min(cols, end); ++j) {
          const T t = std::tanh(x[j] * inv_cap);
          ds[j] *= T(1) - t * t;
        }
      }
    }
    pack_panels<C>(rows, rows, dim, d_pad, q_blk, p.q_row_stride, 1, w.q.data());
    // dK += scale dS^T Q, dQ += scale dS K
    product<C>(cols_pad, d_pad, rows, scale, dp, 1, kKeyBlock, w.q.data(), rows * C::NR, dk, d_pad, true,
               visible(Visible::kInnerFromRow));
    product<C>(rows, d_pad, cols, scale, dp, kKeyBlock, 1, w.k.data(), cols_pad * C::NR, dq + row0 * d_pad, d_pad,
               true, visible(Visible::kInnerToRow));
  }
  T* grad_k = static_cast<T*>(p.grad_k) + b * p.grad_k_batch_stride + h * p.grad_k_head_stride + j0 * p.grad_k_row_stride;
  T* grad_v = static_cast<T*>(p.grad_v) + b * p.grad_v_batch_stride + h * p.grad_v_head_stride + j0 * p.grad_v_row_stride;
  for (int64_t j = 0; j < cols; ++j) {
    std::copy(dk + j * d_pad, dk + j * d_pad + dim, grad_k + j * p.grad_k_row_stride);
    std::copy(dv + j * dv_pad, dv + j * dv_pad + dim_v, grad_v + j * p.grad_v_row_stride);
  }
}

// Backward tasks [begin, end) in (batch, head, key block) order. dq: this chunk's buffer, one
// [seqlen_q, padded(head_dim)] slice per head from first_bh on.
template <typename C>
ATTN_EXPORT_INLINE void backward_tasks(const AttentionBackwardParams& p, int64_t begin, int64_t end, int64_t first_bh,
                                       typename C::Scalar* dq) {
  using T = typename C::Scalar;
  BackwardScratch<T> w(p);
  std::vector<T> d_rows(p.seqlen_q);
  const int64_t blocks = ceil_div(p.seqlen_k, kKeyBlock);
  const int64_t slice = p.seqlen_q * padded(p.head_dim);
  for (int64_t t = begin, head = -1; t < end; ++t) {
    const int64_t bh = t / blocks, j0 = (t % blocks) * kKeyBlock, b = bh / p.num_heads, h = bh % p.num_heads;
    if (bh != head) {
      // D = rowsum(dO * O), summed in the order and with the contraction of the product that
      // gives dP = dO V^T: with a single visible key, O = v exactly and dS = P (dP - D) is then
      // exactly 0, as the exact gradient is.
      const T* o = static_cast<const T*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
      const T* g = static_cast<const T*>(p.grad_out) + b * p.grad_out_batch_stride + h * p.grad_out_head_stride;
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        T acc = 0;
        for (int64_t d = 0; d < p.head_dim_v; ++d) {
          const T x = g[i * p.grad_out_row_stride + d], y = o[i * p.out_row_stride + d];
          acc = C::kFma ? std::fma(x, y, acc) : acc + x * y;
        }
        d_rows[i] = acc;
      }
      head = bh;
    }
    backward_block<C>(p, b, h, j0, std::min(kKeyBlock, p.seqlen_k - j0), d_rows.data(), dq + (bh - first_bh) * slice, w);
  }
}

// The tile configurations. AVX-512: 8 x 32 floats of accumulators (16 of 32 registers); AVX2:
// 6 x 16 (12 of 16); baseline SSE: 4 x 8 floats or 4 x 4 doubles.
using Avx512 = Tiles<float, 16, 8, 2, true>;
using Avx2 = Tiles<float, 8, 6, 2, true>;
using GenericF = Tiles<float, 4, 4, 2>;
using GenericD = Tiles<double, 2, 4, 2>;

#if defined(__GNUC__) && defined(__x86_64__)
#define ATTN_EXPORT_X86 1
#define ATTN_EXPORT_TARGET(isa) __attribute__((target(isa)))
#else
#define ATTN_EXPORT_TARGET(isa)
#endif

#define ATTN_EXPORT_FLASH_ENTRIES(NAME, CONFIG, TARGET)                                                        \
  TARGET void forward_##NAME(const AttentionParams& p, int64_t begin, int64_t end) {                           \
    forward_tasks<CONFIG>(p, begin, end);                                                                      \
  }                                                                                                            \
  TARGET void backward_##NAME(const AttentionBackwardParams& p, int64_t begin, int64_t end, int64_t first_bh, \
                              CONFIG::Scalar* dq) {                                                            \
    backward_tasks<CONFIG>(p, begin, end, first_bh, dq);                                                       \
  }

ATTN_EXPORT_FLASH_ENTRIES(generic_f32, GenericF, )
ATTN_EXPORT_FLASH_ENTRIES(generic_f64, GenericD, )
#ifdef ATTN_EXPORT_X86
ATTN_EXPORT_FLASH_ENTRIES(avx2, Avx2, ATTN_EXPORT_TARGET("avx2,fma"))
ATTN_EXPORT_FLASH_ENTRIES(avx512, Avx512, ATTN_EXPORT_TARGET("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))
#endif

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa detect_isa() {
  Isa best = Isa::kGeneric;
#ifdef ATTN_EXPORT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    best = Isa::kAvx2;
  }
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
    best = Isa::kAvx512;
  }
#endif
  const IsaLevel limit = isa_limit();
  if (limit == IsaLevel::generic) {
    best = Isa::kGeneric;
  } else if (limit == IsaLevel::avx2 && best == Isa::kAvx512) {
    best = Isa::kAvx2;
  }
  return best;
}

Isa current_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

using ForwardFn = void (*)(const AttentionParams&, int64_t, int64_t);
template <typename T>
using BackwardFn = void (*)(const AttentionBackwardParams&, int64_t, int64_t, int64_t, T*);

ForwardFn forward_fn_f32() {
  switch (current_isa()) {
#ifdef ATTN_EXPORT_X86
    case Isa::kAvx512:
      return forward_avx512;
    case Isa::kAvx2:
      return forward_avx2;
#endif
    default:
      return forward_generic_f32;
  }
}

BackwardFn<float> backward_fn_f32() {
  switch (current_isa()) {
#ifdef ATTN_EXPORT_X86
    case Isa::kAvx512:
      return backward_avx512;
    case Isa::kAvx2:
      return backward_avx2;
#endif
    default:
      return backward_generic_f32;
  }
}

// Multiply-adds below which a parallel chunk is not worth waking another thread for.
constexpr int64_t kMinChunkWork = 1 << 15;

template <typename T>
void run_forward(const AttentionParams& p, ForwardFn fn) {
  const int64_t tasks = p.batch * p.num_heads * ceil_div(p.seqlen_q, kQueryBlock);
  const int64_t task_work = kQueryBlock * p.seqlen_k * (p.head_dim + p.head_dim_v);
  parallel_for(0, tasks, std::max<int64_t>(1, kMinChunkWork / std::max<int64_t>(1, task_work)),
               [&](int64_t begin, int64_t end) { fn(p, begin, end); });
}

template <typename T>
void run_backward(const AttentionBackwardParams& p, BackwardFn<T> fn) {
  const int64_t heads = p.batch * p.num_heads, seqlen_q = p.seqlen_q, dim = p.head_dim;
  const int64_t d_pad = padded(dim);
  if (heads == 0 || seqlen_q == 0) {
    return;
  }
  // Chunks of tasks, one per thread, each with its own dQ buffer over the heads it touches;
  // with heads a multiple of the threads every chunk holds whole heads.
  const int64_t tasks = heads * ceil_div(p.seqlen_k, kKeyBlock);
  if (tasks == 0) {  // no keys: dQ = 0 (and dK, dV are empty)
    for (int64_t bh = 0; bh < heads; ++bh) {
      T* grad_q = static_cast<T*>(p.grad_q) + bh / p.num_heads * p.grad_q_batch_stride +
          bh % p.num_heads * p.grad_q_head_stride;
      for (int64_t i = 0; i < seqlen_q; ++i) {
        std::fill(grad_q + i * p.grad_q_row_stride, grad_q + i * p.grad_q_row_stride + dim, T(0));
      }
    }
    return;
  }
  const int64_t chunks = std::min(num_threads(), tasks);
  const int64_t per_head = tasks / heads, slice = seqlen_q * d_pad;
  auto chunk_begin = [&](int64_t c) { return tasks * c / chunks; };
  auto first_head = [&](int64_t c) { return chunk_begin(c) / per_head; };
  auto last_head = [&](int64_t c) { return (chunk_begin(c + 1) - 1) / per_head; };
  std::vector<std::vector<T>> dq(chunks);
  parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      dq[c].assign((last_head(c) - first_head(c) + 1) * slice, T(0));
      fn(p, chunk_begin(c), chunk_begin(c + 1), first_head(c), dq[c].data());
    }
  });
  parallel_for(0, heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.num_heads, h = bh % p.num_heads;
      T* grad_q = static_cast<T*>(p.grad_q) + b * p.grad_q_batch_stride + h * p.grad_q_head_stride;
      for (int64_t i = 0; i < seqlen_q; ++i) {
        std::fill(grad_q + i * p.grad_q_row_stride, grad_q + i * p.grad_q_row_stride + dim, T(0));
      }
      for (int64_t c = 0; c < chunks; ++c) {
        if (bh < first_head(c) || bh > last_head(c)) {
          continue;
        }
        const T* src = dq[c].data() + (bh - first_head(c)) * slice;
        for (int64_t i = 0; i < seqlen_q; ++i) {
          T* dst = grad_q + i * p.grad_q_row_stride;
          for (int64_t d = 0; d < dim; ++d) {
            dst[d] += src[i * d_pad + d];
          }
        }
      }
    }
  });
}

}  // namespace

bool forward(const AttentionParams& p) {
  if (p.weights != nullptr) {
    return false;
  }
  if (p.dtype == DataType::kFloat32) {
    run_forward<float>(p, forward_fn_f32());
  } else if (p.dtype == DataType::kFloat64) {
    run_forward<double>(p, forward_generic_f64);
  } else {
    return false;
  }
  return true;
}

bool backward(const AttentionBackwardParams& p) {
  if (p.grad_weights != nullptr || p.out == nullptr) {
    return false;
  }
  if (p.dtype == DataType::kFloat32) {
    run_backward<float>(p, backward_fn_f32());
  } else if (p.dtype == DataType::kFloat64) {
    run_backward<double>(p, backward_generic_f64);
  } else {
    return false;
  }
  return true;
}

const char* isa() {
  switch (current_isa()) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

}  // namespace attn_export::cpu::flash

// For Python (ctypes: benchmarks/core.py, tests/ops/cpu/test_instruction_sets.py): isa().
extern "C" __attribute__((visibility("default"))) const char* attn_export_flash_isa() {
  return attn_export::cpu::flash::isa();
}
