// Flash forward: softmax(cap(scale * Q K^T) + masks) V (cap: the optional logit soft-cap) for one (batch, head, block of kBlockM query
// rows) per thread block, on tensor cores (mma.sync m16n8k16, float16/bfloat16 inputs, float32
// accumulation).
//
// Keys and values stream through shared memory kBlockN rows at a time. Each warp owns kRowTiles
// 16-row MMA tiles of query rows (FlashFwdTraits; rows [16 * kRowTiles * warp, + 16 * kRowTiles)
// of the block's) and keeps their scores S, running max, running sum and output O in registers
// (online softmax, FlashAttention-2 style); each K or V fragment it reads from shared memory
// feeds the MMAs of all its row tiles: the Lq x Lk matrix never exists anywhere, and the only
// extra output is the row log-sum-exp the backward needs. Scores live in the log2 domain
// (scale * log2(e) is folded into one multiply) so each probability is one ex2 instruction.
//
// Loads overlap compute with single-buffered K and V tiles and cp.async groups: K(n+1) is
// fetched while the block does the softmax and P V of tile n; V(n+1) while it computes
// S(n+1) = Q K(n+1)^T.
//
// Packed grouped-query heads (kPackGqa, preview only: dispatch_policy.h pack_gqa): a program
// owns one key/value head instead of one query head, and the tile's rows are the rows of the
// group's G query heads, G * seqlen_q of them: packed row R is query R % seqlen_q of query head
// G * kv + R / seqlen_q (FlashAttention's pack_gqa). A decode step (seqlen_q of 1..8) then fills
// the tile with G heads' rows and streams each K/V tile once per key/value head, not G times.
// Every row keeps its own query index (causality, window, the attention mask's row) and head (the
// mask's head, out, lse); lse and the split-KV partials of a group's rows are contiguous
// ([batch, heads, seqlen_q] row-major), so those stores index by R as unpacked.
#pragma once

#include <utility>

#include "block_bounds.h"
#include "device_primitives.cuh"
#include "element.cuh"
#include "kernel_traits.h"
#include "key_tile_range.cuh"
#include "launch.h"
#include "split_kv.h"
#include "split_kv_combine.cuh"

namespace attn_export::cuda {
namespace device {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// Rows [row0, row0 + kRows) of a [seqlen, cols] matrix (rows `row_stride` elements apart, each
// contiguous) into a shared [kRows][kHeadDim] tile whose rows are kRowStride elements apart, 16
// bytes per cp.async. Rows at or past `seqlen`, and columns at or past `cols` (the operand's own
// head dim, a multiple of 8 elements, padded up to the compiled kHeadDim), are zero-filled
// without being read: the zeros add nothing to any product over the head dim.
// row_offset(row): where a row starts in gmem, in elements (load_tile_async: row * row_stride).
template <int kRows, int kHeadDim, int kRowStride, int kNThreads, typename Element, typename RowOffset>
__device__ __forceinline__ void load_rows_async(Element* smem, const Element* gmem, int row0, int seqlen, int cols,
                                                RowOffset row_offset) {
  constexpr int kElemsPerChunk = 16 / sizeof(Element);
  constexpr int kChunksPerRow = kHeadDim / kElemsPerChunk;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % kNThreads == 0, "every thread issues the same number of copies");
#pragma unroll
  for (int i = threadIdx.x; i < kChunks; i += kNThreads) {
    const int r = i / kChunksPerRow, c = i % kChunksPerRow;
    const bool valid = row0 + r < seqlen && c * kElemsPerChunk < cols;
    // An invalid chunk reads nothing, but the address handed to cp.async must still be legal.
    const Element* src = gmem + (valid ? row_offset(row0 + r) + c * kElemsPerChunk : 0);
    cp_async_16(smem + r * kRowStride + c * kElemsPerChunk, src, valid);
  }
}

template <int kRows, int kHeadDim, int kRowStride, int kNThreads, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem,
                                                int64_t row_stride, int row0, int seqlen, int cols) {
  load_rows_async<kRows, kHeadDim, kRowStride, kNThreads>(smem, gmem, row0, seqlen, cols,
                                                          [row_stride](int row) { return row * row_stride; });
}

// The rows of one program's query tile (kPackGqa above): unpacked, row R is query R of the
// program's head; packed, query R % seqlen_q of head `head0 + R / seqlen_q`, of `rows` = G *
// seqlen_q. Each thread maps its own two rows once, before the key loop.
template <bool kPackGqa>
struct QueryRows {
  int seqlen_q = 0, rows = 0;

  __device__ QueryRows(const AttentionParams& p, int group)
      : seqlen_q(static_cast<int>(p.seqlen_q)), rows(kPackGqa ? group * static_cast<int>(p.seqlen_q)
                                                              : static_cast<int>(p.seqlen_q)) {}
  // Of packed row R (< rows): the head past the program's first, and the query index.
  __device__ __forceinline__ int head_of(int row) const { return kPackGqa ? row / seqlen_q : 0; }
  __device__ __forceinline__ int query_of(int row) const { return kPackGqa ? row % seqlen_q : row; }
  // Bounds on the query indices of the live tile rows [m0, min(m0 + kBM, rows)): packed, the
  // first row's query when the tile holds rows of one head only, else 0 (the next head's rows
  // start again at query 0).
  __device__ __forceinline__ int first_query(int m0, int block_m) const {
    if constexpr (kPackGqa) {
      return m0 / seqlen_q == (imin(rows, m0 + block_m) - 1) / seqlen_q ? m0 % seqlen_q : 0;
    }
    return m0;
  }
  __device__ __forceinline__ int last_query(int m0, int block_m) const {
    return kPackGqa ? imin(seqlen_q - 1, m0 + block_m - 1) : m0 + block_m - 1;
  }
};

// Stores two adjacent elements (a float pair from an accumulator fragment) with one 4-byte store.
template <typename Element>
__device__ __forceinline__ void store_pair(Element* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = pack2<Element>(lo, hi);
}

// Stores a thread's pairs of one accumulator row, 8-column tiles [0, kTiles) from `col0` of the
// tile on, into `row` (whose column 0 is the tile's column col0 + col_in_tile): only the
// columns below `cols`, the operand's own head dim, exist in memory (a multiple of 8, so a
// pair is wholly in or out). r picks the fragment's row (0: g, 1: g + 8).
template <int kTiles, typename Element>
__device__ __forceinline__ void store_row(Element* row, const float (&acc)[kTiles][4], int r, float mul,
                                          int col0, int cols) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    if (col0 + t * 8 < cols) {
      store_pair(row + t * 8, acc[t][2 * r] * mul, acc[t][2 * r + 1] * mul);
    }
  }
}

// Calls f(std::integral_constant<int, I>{}) for I = 0 .. N-1 in order: an unrolled loop whose
// index is a constant expression, so register arrays indexed by it stay in registers.
template <typename F, int... I>
__device__ __forceinline__ void unrolled_(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
__device__ __forceinline__ void unrolled(F&& f) {
  unrolled_(f, std::make_integer_sequence<int, N>{});
}

// Writes the chunk's partial result of one accumulator row (split-KV, split_kv.h): the output
// normalized over the chunk (scaled by `inv`) in float32, columns below `cols` only, and (by
// the quad's first thread) the chunk's log-sum-exp.
template <int kTiles>
__device__ __forceinline__ void store_partial_row(float* row, float* lse, const float (&acc)[kTiles][4], int r,
                                                  float inv, float row_lse, int col_in_tile, int cols, int lane) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    if (t * 8 < cols) {
      row[t * 8 + col_in_tile] = acc[t][2 * r] * inv;
      row[t * 8 + col_in_tile + 1] = acc[t][2 * r + 1] * inv;
    }
  }
  if (lane % 4 == 0) {
    *lse = row_lse;
  }
}

// Online softmax of accumulator row r (0: g, 1: g + 8) of one row tile, after a key tile's scores
// (log2 domain) landed in acc_s: the running max and sum move on, O is rescaled, and acc_s turns
// into the tile's probabilities. The 4 threads of a quad share a row: row reductions are two shuffles.
template <int kSTiles, int kOTiles>
__device__ __forceinline__ void online_softmax_row(float (&acc_s)[kSTiles][4], float (&acc_o)[kOTiles][4],
                                                   float& row_max, float& row_sum, int r) {
  float mx = row_max;
#pragma unroll
  for (int nt = 0; nt < kSTiles; ++nt) {
    mx = fmaxf(mx, fmaxf(acc_s[nt][2 * r], acc_s[nt][2 * r + 1]));
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  // A row that has seen no visible key keeps max = -inf. Subtracting 0 instead keeps every
  // exponent at -inf (never -inf - -inf = NaN): its probabilities and correction become 0.
  const float m_use = mx == neg_inf<float>() ? 0.f : mx;
  const float correction = fast_exp2(row_max - m_use);
  row_max = mx;
  row_sum *= correction;
#pragma unroll
  for (int dt = 0; dt < kOTiles; ++dt) {
    acc_o[dt][2 * r] *= correction;
    acc_o[dt][2 * r + 1] *= correction;
  }
#pragma unroll
  for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float p = fast_exp2(acc_s[nt][2 * r + j] - m_use);
      acc_s[nt][2 * r + j] = p;
      row_sum += p;
    }
  }
}

// The A fragment of 16-key step ks of P V: the S accumulators of two adjacent 8-key tiles are
// exactly it (see device_primitives.cuh), so P never leaves registers.
template <typename Element, int kSTiles>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const float (&acc_s)[kSTiles][4], int ks) {
  a[0] = pack2<Element>(acc_s[2 * ks][0], acc_s[2 * ks][1]);
  a[1] = pack2<Element>(acc_s[2 * ks][2], acc_s[2 * ks][3]);
  a[2] = pack2<Element>(acc_s[2 * ks + 1][0], acc_s[2 * ks + 1][1]);
  a[3] = pack2<Element>(acc_s[2 * ks + 1][2], acc_s[2 * ks + 1][3]);
}

// The body of both forward kernels below. kSplit: this program covers key chunk
// blockIdx.z % split.num_splits of batch row blockIdx.z / split.num_splits only, and writes a
// partial result (split_kv.h) instead of out/lse. kPackGqa: blockIdx.y is a key/value head whose
// group's query heads share the tile's rows (QueryRows).
template <typename Traits, typename Element, bool kIsCausal, bool kSplit, bool kPackGqa>
__device__ __forceinline__ void flash_fwd_program(const AttentionParams& params, const SplitKv split) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  constexpr int kD = Traits::kHeadDim, kBM = Traits::kBlockM, kBN = Traits::kBlockN;
  constexpr int kRS = Traits::kRowStride, kNT = Traits::kNThreads, kRT = Traits::kRowTiles;
  constexpr int kSTiles = kBN / 8;  // 8-column accumulator tiles of one row tile's S
  constexpr int kOTiles = kD / 8;   // ... and of its O

  Element* sQ = shared_memory<Element>();
  Element* sK = sQ + kBM * kRS;
  Element* sV = sK + kBN * kRS;

  const int m0 = blockIdx.x * kBM;
  // The program's (first) query head: packed, the first of key/value head blockIdx.y's group.
  const int group = kPackGqa ? static_cast<int>(params.num_heads / params.num_heads_k) : 1;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * group;
  const QueryRows<kPackGqa> qrows(params, group);
  const int64_t b = kSplit ? blockIdx.z / split.num_splits : blockIdx.z;
  const int chunk = kSplit ? static_cast<int>(blockIdx.z % split.num_splits) : 0;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int seqlen_q = static_cast<int>(params.seqlen_q), seqlen_k = static_cast<int>(params.seqlen_k);
  const int dim = static_cast<int>(params.head_dim), dim_v = static_cast<int>(params.head_dim_v);

  const Element* q = static_cast<const Element*>(params.q) + b * params.q_batch_stride + h * params.q_head_stride;
  const int64_t kv = params.kv_head(h);  // grouped-query attention: the group's key/value head
  const Element* k = static_cast<const Element*>(params.k) + b * params.k_batch_stride + kv * params.k_head_stride;
  const Element* v = static_cast<const Element*>(params.v) + b * params.v_batch_stride + kv * params.v_head_stride;

  // Causal: the key tiles some row of this block can see (block_bounds.h): none past its last
  // query's diagonal, none wholly before its first query's window (none at all for a block of rows
  // that see no key). Packed, the first query is the least over the tile's live rows
  // (QueryRows::first_query). ScoreMask still masks each score of the tiles visited.
  const int shift = kIsCausal ? static_cast<int>(params.causal_shift()) : 0;
  const bounds::TileRange visible =
      bounds::key_tiles<kBN, kIsCausal>(params, qrows.first_query(m0, kBM), qrows.last_query(m0, kBM));
  const int n_blocks_all = visible.end, window_begin = visible.begin;
  // Without a split, tiles [window_begin, n_blocks_all); with one, this chunk's share of
  // [0, n_blocks_all) intersected with them (maybe none); either clamped to the tiles holding a
  // key the padding mask leaves visible (sK is free yet).
  const int chunk_begin = kSplit ? imin(n_blocks_all, chunk * split.blocks_per_split) : 0;
  const int chunk_end = kSplit ? imin(n_blocks_all, chunk_begin + split.blocks_per_split) : n_blocks_all;
  const bounds::TileRange tiles =
      key_tile_range<kBN, kNT>(params, b, imax(chunk_begin, window_begin), chunk_end, reinterpret_cast<int*>(sK));
  const int n_begin = tiles.begin, n_blocks = tiles.end;

  // cp.async groups, in order: {Q, K0}, {V0}; then per tile n: {K(n+1)}, {V(n+1)} (possibly
  // empty). "Wait until at most one group is pending" therefore always means "the tile about
  // to be used has landed" while the next one is still in flight.
  if constexpr (kPackGqa) {
    load_rows_async<kBM, kD, kRS, kNT>(sQ, q, m0, qrows.rows, dim, [&](int row) {
      return qrows.head_of(row) * params.q_head_stride + qrows.query_of(row) * params.q_row_stride;
    });
  } else {
    load_tile_async<kBM, kD, kRS, kNT>(sQ, q, params.q_row_stride, m0, seqlen_q, dim);
  }
  if (n_blocks > n_begin) {
    load_tile_async<kBN, kD, kRS, kNT>(sK, k, params.k_row_stride, n_begin * kBN, seqlen_k, dim);
  }
  cp_async_commit();
  if (n_blocks > n_begin) {
    load_tile_async<kBN, kD, kRS, kNT>(sV, v, params.v_row_stride, n_begin * kBN, seqlen_k, dim_v);
  }
  cp_async_commit();

  // The warp's rows in the block's tile start at warp_row0; this thread's two rows of row tile t
  // (16 rows each): r = 0 -> row_of(t, 0), r = 1 -> row_of(t, 0) + 8.
  const int warp_row0 = warp * 16 * kRT;
  const auto row_of = [&](int t, int r) { return m0 + warp_row0 + t * 16 + r * 8 + lane / 4; };
  const int col_in_tile = (lane % 4) * 2;
  const float scale_log2 = static_cast<float>(params.scale) * kLog2e;
  const float scale = static_cast<float>(params.scale);
  const ScoreMask<float> mask(params, b, h, kLog2e);
  const SoftCap<float> softcap(params);
  // Packed: the query index and attention-mask row (from head h's slice) of this thread's two
  // rows; a dead row past the group's gets query seqlen_q, which the mask hides entirely.
  int query[kRT][2] = {};
  int64_t attn_row[kRT][2] = {};
  if constexpr (kPackGqa) {
#pragma unroll
    for (int t = 0; t < kRT; ++t) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_of(t, r);
        const bool live = row < qrows.rows;
        query[t][r] = live ? qrows.query_of(row) : seqlen_q;
        attn_row[t][r] =
            live ? qrows.head_of(row) * params.attn_mask.head_stride + query[t][r] * params.attn_mask.row_stride : 0;
      }
    }
  }

  // ALiBi (element.cuh Alibi): the slope of each of this thread's rows in the log2 domain, from the
  // row's own head when packed (0 for a dead row, which the mask hides); nothing is read without slopes.
  const bool alibi_on = params.alibi_slopes != nullptr;
  const int alibi_diagonal = seqlen_k - seqlen_q;
  float alibi_slope[kRT][2] = {};
  if (alibi_on) {
#pragma unroll
    for (int t = 0; t < kRT; ++t) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row_of(t, r);
        alibi_slope[t][r] = !kPackGqa ? params.alibi_slopes[h] * kLog2e
            : row < qrows.rows        ? params.alibi_slopes[h + qrows.head_of(row)] * kLog2e
                                      : 0.f;
      }
    }
  }

  float acc_o[kRT][kOTiles][4] = {};
  float row_max[kRT][2], row_sum[kRT][2];  // row_sum: this thread's partial sums; the quad reduces them at the end
#pragma unroll
  for (int t = 0; t < kRT; ++t) {
    row_max[t][0] = row_max[t][1] = neg_inf<float>();
    row_sum[t][0] = row_sum[t][1] = 0.f;
  }

  for (int n = n_begin; n < n_blocks; ++n) {
    const int n0 = n * kBN;
    cp_async_wait<1>();
    __syncthreads();  // Q and K(n) are in shared memory, for every thread

    // S = Q K^T for each of the warp's row tiles (16 rows x kBN keys). A = Q rows (ldmatrix); B =
    // K^T, i.e. K rows read as "col" fragments: two 8-key tiles per ldmatrix.x4, each fragment
    // used by every row tile.
    float acc_s[kRT][kSTiles][4] = {};
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      uint32_t a[kRT][4];
#pragma unroll
      for (int t = 0; t < kRT; ++t) {
        ldmatrix_x4(a[t], sQ + (warp_row0 + t * 16 + lane % 16) * kRS + ks * 16 + (lane / 16) * 8);
      }
#pragma unroll
      for (int np = 0; np < kBN / 16; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, sK + (np * 16 + (lane / 16) * 8 + lane % 8) * kRS + ks * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int t = 0; t < kRT; ++t) {
          mma_16816<Element>(acc_s[t][2 * np], a[t], bk[0], bk[1]);
          mma_16816<Element>(acc_s[t][2 * np + 1], a[t], bk[2], bk[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with sK: refill it with K(n+1)
    if (n + 1 < n_blocks) {
      load_tile_async<kBN, kD, kRS, kNT>(sK, k, params.k_row_stride, n0 + kBN, seqlen_k, dim);
    }
    cp_async_commit();

    // Scale (and soft-cap) into the log2 domain; mask only the tiles that can need it.
    const bool masked_tile = mask.reads_memory() || n0 + kBN > seqlen_k ||
        (kIsCausal &&
         bounds::causal_edge_in_tile(params, qrows.first_query(m0, kBM), qrows.last_query(m0, kBM), n0, kBN, shift));
    // Unrolled by the template, not by `#pragma unroll`: cicc left that loop rolled in the
    // split-KV kernel, which put acc_s in local memory and multiplied its code (and compile time) tenfold.
    unrolled<kRT * kSTiles * 4>([&](auto e) {
      constexpr int t = decltype(e)::value / (kSTiles * 4);
      constexpr int nt = decltype(e)::value / 4 % kSTiles, i = decltype(e)::value % 4;
      float s = softcap.on ? softcap.apply(acc_s[t][nt][i] * scale) * kLog2e : acc_s[t][nt][i] * scale_log2;
      if (masked_tile) {
        const int col = n0 + nt * 8 + col_in_tile + (i % 2);
        if constexpr (kPackGqa) {
          s = mask.apply_at(s, query[t][i / 2], col, attn_row[t][i / 2]);
        } else {
          s = mask.apply(s, row_of(t, i / 2), col);
        }
      }
      if (alibi_on) {  // -slope * |query + seqlen_k - seqlen_q - key|, after the masks (-inf stays -inf)
        const int col = n0 + nt * 8 + col_in_tile + (i % 2);
        const int query_i = kPackGqa ? query[t][i / 2] : row_of(t, i / 2);
        s -= alibi_slope[t][i / 2] * static_cast<float>(iabs(query_i + alibi_diagonal - col));
      }
      acc_s[t][nt][i] = s;
    });

#pragma unroll
    for (int t = 0; t < kRT; ++t) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        online_softmax_row(acc_s[t], acc_o[t], row_max[t][r], row_sum[t][r], r);
      }
    }

    cp_async_wait<1>();
    __syncthreads();  // V(n) is in shared memory (K(n+1) may still be in flight)

    // O += P V, each row tile's P from its own registers (p_fragment). B = V rows read
    // transposed (ldmatrix .trans): two 8-wide head-dim tiles per ldmatrix.x4, each fragment
    // used by every row tile.
#pragma unroll
    for (int ks = 0; ks < kBN / 16; ++ks) {
      uint32_t a[kRT][4];
#pragma unroll
      for (int t = 0; t < kRT; ++t) {
        p_fragment<Element>(a[t], acc_s[t], ks);
      }
#pragma unroll
      for (int dd = 0; dd < kD / 16; ++dd) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, sV + (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kRS + dd * 16 + (lane / 16) * 8);
#pragma unroll
        for (int t = 0; t < kRT; ++t) {
          mma_16816<Element>(acc_o[t][2 * dd], a[t], bv[0], bv[1]);
          mma_16816<Element>(acc_o[t][2 * dd + 1], a[t], bv[2], bv[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with sV: refill it with V(n+1)
    if (n + 1 < n_blocks) {
      load_tile_async<kBN, kD, kRS, kNT>(sV, v, params.v_row_stride, n0 + kBN, seqlen_k, dim_v);
    }
    cp_async_commit();
  }
  cp_async_wait<0>();  // nothing may still be in flight when the block exits

  // Normalize and write O and the log-sum-exp (natural log: lse = max * ln 2 + ln(sum)).
  // A row with no visible key has sum 0: zero output and lse = -inf, as the CPU kernel.
  // Packed or not, tile row R's lse (and split partial) is R past row0.
  const int64_t row0 = (b * params.num_heads + h) * params.seqlen_q;  // of this (batch, head) in lse
  const int64_t chunk_row0 = kSplit ? chunk * params.batch * params.num_heads * params.seqlen_q + row0 : 0;
  Element* out = static_cast<Element*>(params.out) + b * params.out_batch_stride + h * params.out_head_stride;
  float* lse = static_cast<float*>(params.lse) + row0;
#pragma unroll
  for (int t = 0; t < kRT; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[t][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int row = row_of(t, r);
      const bool visible = sum > 0.f;
      const float inv = visible ? 1.f / sum : 0.f;
      const float row_lse = visible ? row_max[t][r] * kLn2 + logf(sum) : neg_inf<float>();
      if (row >= qrows.rows) {
        continue;
      }
      if constexpr (kSplit) {
        const int64_t at = chunk_row0 + row;
        store_partial_row(split.out_accum + at * dim_v, split.lse_accum + at, acc_o[t], r, inv, row_lse,
                          col_in_tile, dim_v, lane);
      } else {
        const int64_t out_row = kPackGqa
            ? qrows.head_of(row) * params.out_head_stride + qrows.query_of(row) * params.out_row_stride
            : row * params.out_row_stride;
        store_row(out + out_row + col_in_tile, acc_o[t], r, inv, 0, dim_v);
        if (lane % 4 == 0) {
          lse[row] = row_lse;
        }
      }
    }
  }
#endif
}

template <typename Traits, typename Element, bool kIsCausal, bool kPackGqa>
__global__ void __launch_bounds__(Traits::kNThreads) flash_fwd_kernel(const AttentionParams params) {
  flash_fwd_program<Traits, Element, kIsCausal, false, kPackGqa>(params, SplitKv{});
}

// Split-KV. The minimum of one block per SM lets ptxas use the registers it needs: without it, it
// capped the head-dim-128 program at 128 registers and spilled (the fp32 partial stores).
template <typename Traits, typename Element, bool kIsCausal, bool kPackGqa>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_fwd_split_kernel(const AttentionParams params,
                                                                              const SplitKv split) {
  flash_fwd_program<Traits, Element, kIsCausal, true, kPackGqa>(params, split);
}

// One forward's programs: (query tile, query head, batch), or packed (tile of the group's
// G * seqlen_q rows, key/value head, batch); grid z also holds the key chunks when split.
template <typename Traits, bool kPackGqa>
dim3 flash_fwd_grid(const AttentionParams& params, int num_splits) {
  const int64_t rows = kPackGqa ? params.num_heads / params.num_heads_k * params.seqlen_q : params.seqlen_q;
  const unsigned q_tiles = static_cast<unsigned>((rows + Traits::kBlockM - 1) / Traits::kBlockM);
  const unsigned heads = static_cast<unsigned>(kPackGqa ? params.num_heads_k : params.num_heads);
  return dim3(q_tiles, heads, static_cast<unsigned>(params.batch * num_splits));
}

template <typename Traits, typename Element, bool kIsCausal, bool kPackGqa>
cudaError_t launch_flash_fwd(const AttentionParams& params, const SplitKv& split, cudaStream_t stream) {
  constexpr size_t kSmem = Traits::template smem_bytes<Element>();
  if (split.num_splits <= 1) {
    return launch_kernel(flash_fwd_kernel<Traits, Element, kIsCausal, kPackGqa>,
                         flash_fwd_grid<Traits, kPackGqa>(params, 1), dim3(Traits::kNThreads), kSmem, stream, params);
  }
  if constexpr (Traits::kRowTiles > 1) {
    return cudaErrorInvalidValue;  // the wide tiles are compiled for prefill only: never split
  } else {
    const cudaError_t err =
        launch_kernel(flash_fwd_split_kernel<Traits, Element, kIsCausal, kPackGqa>,
                      flash_fwd_grid<Traits, kPackGqa>(params, split.num_splits), dim3(Traits::kNThreads), kSmem,
                      stream, params, split);
    return err != cudaSuccess ? err : run_split_kv_combine<Element>(params, split, stream);
  }
}

}  // namespace device

// Host launcher, instantiated per (dtype, compiled head dim, causal, row tiles) in
// flash_fwd_hdim*.cu; it runs any max(head_dim, head_dim_v) <= kHeadDim whose dims are multiples
// of 8. With split.num_splits > 1 it launches one program per key chunk too (grid z = batch *
// chunks), then the combine kernel (split_kv_combine.cuh) that writes out and lse. pack_gqa: the
// group's query heads packed into the tiles' rows (the dispatch's choice, dispatch_policy.h
// pack_gqa; needs num_heads_k dividing num_heads). kRowTiles > 1 (FlashFwdTraits; the dispatch's
// choice, dispatch_policy.h wide_forward_tiles): prefill only, neither split nor packed (an
// invalid-value error if asked).
template <typename Element, int kHeadDim, bool kIsCausal, int kRowTiles>
cudaError_t run_flash_fwd_(const AttentionParams& params, const SplitKv& split, bool pack_gqa, cudaStream_t stream) {
  using Traits = FlashFwdTraits<kHeadDim, kRowTiles>;
  static_assert(Traits::template smem_bytes<Element>() <= kSm80SmemOptin, "the tile must fit sm_80's shared memory");
  if constexpr (kRowTiles > 1) {
    if (pack_gqa) {
      return cudaErrorInvalidValue;
    }
    return device::launch_flash_fwd<Traits, Element, kIsCausal, false>(params, split, stream);
  } else {
    return pack_gqa ? device::launch_flash_fwd<Traits, Element, kIsCausal, true>(params, split, stream)
                    : device::launch_flash_fwd<Traits, Element, kIsCausal, false>(params, split, stream);
  }
}

}  // namespace attn_export::cuda
