// Tile sizes of the flash (tensor-core) kernels, in one place per head dim.
//
// Each warp owns 16-row MMA tiles: in the forward, kRowTiles of 16 query rows (so a block covers
// kBlockM = 16 * kNWarps * kRowTiles queries and streams keys kBlockN at a time); in the backward, 16 key
// rows (a block owns kBlockN = 16 * kKeyWarps keys and streams queries kBlockM at a time).
// Shared-memory rows are padded by 8 elements (16 bytes): rows stay 16-byte aligned for
// cp.async and ldmatrix, and the 8 row addresses of one ldmatrix phase fall on distinct banks.
//
// These are choices made without a GPU at hand, held to no register spills on sm_80 and sm_90
// by test_flash_kernels_do_not_spill (tests/ops/cuda/test_cuda_build.py, `nvcc -Xptxas -v`); tuning
// them on a GPU is a change of this file only.
#pragma once

#include <cstddef>
#include <cstdint>

namespace attn_export::cuda {

// Accumulation type: float for float16, bfloat16 and float32, double for float64.
template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Accumulator<T>::type;

inline constexpr int kSmemPad = 8;

// The head dims the flash kernels are compiled for: the one table. generate_kernels.py reads it
// to write instantiations/, and the dispatch (attention_cuda.cu) runs a problem on the smallest
// entry >= max(head_dim, head_dim_v), the columns past each operand's own size masked.
inline constexpr int kFlashHeadDims[] = {32, 64, 96, 128, 192, 256};
inline constexpr int kNumFlashHeadDims = sizeof(kFlashHeadDims) / sizeof(kFlashHeadDims[0]);
inline constexpr int kMaxFlashHeadDim = kFlashHeadDims[kNumFlashHeadDims - 1];

// Whether head_dim and head_dim_v are equal and one of `table`'s head dims (the dispatch policy's
// verified ones, the Hopper forward's compiled ones).
template <std::size_t N>
constexpr bool equal_head_dims_in(const int (&table)[N], int64_t head_dim, int64_t head_dim_v) {
  if (head_dim != head_dim_v) {
    return false;
  }
  for (int d : table) {
    if (head_dim == d) {
      return true;
    }
  }
  return false;
}

// Smallest compiled head dim >= dim, or 0 when there is none.
constexpr int flash_tile_head_dim(int64_t dim) {
  for (int d : kFlashHeadDims) {
    if (dim <= d) {
      return d;
    }
  }
  return 0;
}

// Forward tiles. A warp keeps its kRowTiles 16 x kHeadDim outputs (kHeadDim / 2 floats a thread
// each) and 16 x kBlockN score tiles (kBlockN / 4 floats each) in registers: above 128 the key
// tile shrinks to 32 so that the sum stays under the 255-register ceiling without spills.
// kRowTiles: the 16-row MMA tiles of each warp. With 2 (FlashAttention-2's 128 rows on 4 warps),
// every K and V fragment a warp reads from shared memory feeds two MMAs, and a block streams each
// K/V tile once for twice the query rows; the price is twice the accumulators (and fewer
// programs). Compiled for the prefill kernel at kWideFwdHeadDims only (preview: dispatch_policy.h
// wide_forward_tiles).
template <int kHeadDim_, int kRowTiles_ = 1>
struct FlashFwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRowTiles = kRowTiles_;
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockM = 16 * kNWarps * kRowTiles;
  // Two row tiles hold twice the O and S accumulators, so their key tile is half (a quarter at
  // 128) of one row tile's: with the one-row-tile key tiles ptxas spilled on sm_80 (head dim 32:
  // ~1 KB; 64: 40 B; 128: ~500 B, and still 20-80 B with 32 keys). These keep 0 spills at
  // 224-246 registers (32, 128) and 168-176 (64); FlashAttention-2 holds 128 x 64 at head dim
  // 128 in 255 registers, which these kernels, with more live state outside the tiles, do not.
  static constexpr int kBlockN = kRowTiles == 1 ? (kHeadDim <= 32 ? 128 : kHeadDim <= 128 ? 64 : 32)
                                                : (kHeadDim <= 32 ? 64 : kHeadDim <= 64 ? 32 : 16);
  static constexpr int kRowStride = kHeadDim + kSmemPad;  // of sQ, sK, sV, in elements

  static_assert(kHeadDim % 16 == 0 && kBlockN % 16 == 0 && kRowTiles >= 1);

  // sQ [kBlockM][kRowStride], sK and sV [kBlockN][kRowStride].
  template <typename Element>
  static constexpr size_t smem_bytes() {
    return sizeof(Element) * static_cast<size_t>(kBlockM + 2 * kBlockN) * kRowStride;
  }
};

// The head dims whose prefill forward is also compiled with two row tiles a warp (128 query rows
// a block): generate_kernels.py reads this table, and the dispatch widens only these.
inline constexpr int kWideFwdRowTiles = 2;
// Not 128: its two row tiles fit the registers only with 16-key tiles, which would rescale the
// 2 x 64 output floats a thread and synchronize the block every 16 keys (4x the 64-row kernel's
// per key); FlashAttention-2 never goes below 32 keys at 128 rows. A GPU may say otherwise.
inline constexpr int kWideFwdHeadDims[] = {32, 64};

constexpr bool wide_fwd_head_dim(int tile_dim) {
  for (int d : kWideFwdHeadDims) {
    if (d == tile_dim) {
      return true;
    }
  }
  return false;
}

// Backward tiles. Each key warp owns 16 key rows; its dK and dV (16 x kHeadDim each) live in
// registers, kHeadDim floats a thread, too many beside S^T and dP^T above head dim 96. There
// the head dim of dK and dV is split over kColSplit warps that share the same 16 keys: each
// recomputes their S^T and dP^T (the two products that reduce over the head dim, so 2 of the
// 5 matrix products are done twice) and accumulates only its kHeadDim / kColSplit columns.
constexpr int flash_bwd_col_split(int head_dim) {
  return head_dim <= 96 ? 1 : 2;
}
// The head dim whose backward is also compiled without the split (kColSplit 1: 4 warps, 64 keys
// x 32 queries), the tiling verified on a GPU at f427ebe, which the dispatch runs unless the
// preview switch is on (dispatch_policy.h). It spills a little, as it did there (now 20/16 B on
// sm_80, 4/8 B on sm_90, not causal); the spill gate allows it up to f427ebe's 96 B, no other kernel any.
inline constexpr int kFlashBwdUnsplitHeadDim = 128;

template <int kHeadDim_, int kColSplit_ = flash_bwd_col_split(kHeadDim_)>
struct FlashBwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kKeyWarps = 4;
  static constexpr int kColSplit = kColSplit_;
  static constexpr int kNWarps = kKeyWarps * kColSplit;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kBlockN = 16 * kKeyWarps;            // keys owned by a block
  // Queries per step; at 256 the S^T and dP^T tiles shrink to 16 queries to avoid spills.
  static constexpr int kBlockM = kHeadDim <= 64 ? 64 : kHeadDim <= 192 ? 32 : 16;
  static constexpr int kColsPerWarp = kHeadDim / kColSplit;  // of dK, dV
  static constexpr int kRowStride = kHeadDim + kSmemPad;     // of sK, sV, sQ, sdO
  static constexpr int kDsRowStride = kBlockN + kSmemPad;    // of sdS [kBlockM][kBlockN]
  // dQ = dS K is split over the warps as a kDqWarpsM x kDqWarpsN grid of 16 x kDqCols tiles.
  static constexpr int kDqWarpsM = kBlockM / 16;
  static constexpr int kDqWarpsN = kNWarps / kDqWarpsM;
  static constexpr int kDqCols = kHeadDim / kDqWarpsN;

  static_assert(kHeadDim % 16 == 0 && kBlockM % 16 == 0 && kColsPerWarp % 16 == 0);
  static_assert(kDqWarpsM * kDqWarpsN == kNWarps && kDqCols % 16 == 0);

  // sK, sV [kBlockN][kRowStride]; sQ, sdO double-buffered [2][kBlockM][kRowStride];
  // sdS [kBlockM][kDsRowStride]; then floats: lse and delta, double-buffered [2][kBlockM] each.
  template <typename Element>
  static constexpr size_t smem_elements_bytes() {
    return sizeof(Element) *
        (static_cast<size_t>(2 * kBlockN + 4 * kBlockM) * kRowStride +
         static_cast<size_t>(kBlockM) * kDsRowStride);
  }
  template <typename Element>
  static constexpr size_t smem_bytes() {
    return smem_elements_bytes<Element>() + sizeof(float) * 4 * kBlockM;
  }
};

// Shared memory a block may opt into: sm_80's 163 KB (sm_90 allows 227 KB). Every flash tile
// must fit the smaller, so one build serves both.
inline constexpr size_t kSm80SmemOptin = 163 * 1024;

// The generic (CUDA-core) kernels: one warp per query row (forward, dQ) or key row (dK, dV);
// lane l holds elements l, l + 32, ... of the head dim, kRegs of them.
inline constexpr int kGenericWarps = 4;

}  // namespace attn_export::cuda
