// Tiles, shared-memory layouts, tensor-core operations and copy descriptors of the Hopper
// backward, in one place (flash_bwd_sm90_kernel.cuh). The tile sizes come from kBwdTiles
// (flash_bwd_sm90.h); everything else follows from them.
//
// One thread block owns kBlockN = 128 keys of one (batch, key/value head): warpgroup 0 produces
// (one thread issues the TMA loads), warpgroups 1 and 2 compute, 64 keys each (wgmma's M), so that
// S^T = K Q^T and dP^T = V dO^T come out with keys as rows: their accumulators, converted to 16
// bits, are directly the A operands of dV += P^T dO and dK += dS^T Q (register-sourced wgmma).
// dQ = dS K needs dS with queries as rows: dS goes through shared memory once per query block.
//
// The swapped rows (kSwapdKV, head dims 192 and 256) own kBlockN = 64 keys: the warpgroups split
// S^T and dP^T by queries, P^T and dS^T go through shared memory, and dV^T += dO^T P and dK^T +=
// Q^T dS (head dim x keys, both operands in shared memory) split the keys, 32 each: 2 x 48 or
// 2 x 64 accumulator registers instead of 2 x 96 or 2 x 128.
#pragma once

// wgmma N = 48 (dQ's per-warpgroup half of head dim 96) is one of CuTe's extended shapes; the
// switch must precede CuTe's first inclusion in the unit (as the forward's, flash_fwd_sm90_traits.cuh).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED 1
#endif

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cuda_fp16.h>

#include <cstdint>

#include "../../../attention_params.h"
#include "flash_bwd_sm90.h"
#include "flash_fwd_sm90_traits.cuh"

namespace attn_export::cuda::sm90 {

using namespace cute;

template <typename Element_, int kHeadDim_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = bwd_tile(kHeadDim).block_m;
  static constexpr int kBlockN = bwd_tile(kHeadDim).block_n;
  static_assert(kBlockM > 0, "a head dim without a row in kBwdTiles (flash_bwd_sm90.h)");
  // The row's partition (flash_bwd_sm90.h): dK^T and dV^T with P^T and dS^T through shared memory.
  static constexpr bool kSwapdKV = bwd_tile(kHeadDim).swap_dkv;
  static_assert(kHeadDim % 32 == 0 && kBlockM % 64 == 0 && kBlockN == (kSwapdKV ? 64 : 128),
                "the layouts below assume these");
  // Query blocks (Q, dO, lse, delta) in flight. 2: the stage index also picks the dS buffer
  // (stage % kDsBuffers).
  static constexpr int kStages = 2;
  // dS (and, swapped, P) buffers: 2, so that one warpgroup writes the next block's while the other
  // still reads this one's; 1 at d256, where a second pair would pass 227 KB (a barrier instead).
  static constexpr int kDsBuffers = kSwapdKV && kHeadDim > 192 ? 1 : 2;
  static constexpr int kMmaWarpgroups = 2;
  static constexpr int kThreads = 128 * (kMmaWarpgroups + 1);
  static constexpr int kMmaThreads = 128 * kMmaWarpgroups;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using Stages = Int<kStages>;
  using KeysPerWarpgroup = Int<kBlockN / kMmaWarpgroups>;
  using TileKQ = Shape<BlockN, BlockM>;   // S^T, dP^T: keys x queries
  using TileKD = Shape<BlockN, HeadDim>;  // K, V (and dK, dV unswapped)
  using TileQD = Shape<BlockM, HeadDim>;  // dQ
  // dK and dV's accumulators: keys x head dim, or swapped head dim x keys.
  using TileDKV = std::conditional_t<kSwapdKV, Shape<HeadDim, BlockN>, TileKD>;

  // The warpgroups split the keys (M) of S^T, dP^T, dV and dK; swapped, the queries (N) of S^T and
  // dP^T (64 keys are one wgmma M) and the keys (N) of dV^T and dK^T.
  using AtomLayoutKeys = Layout<Shape<Int<kMmaWarpgroups>, _1, _1>>;
  using AtomLayoutCols = Layout<Shape<_1, Int<kMmaWarpgroups>, _1>>;
  using AtomLayoutSdP = std::conditional_t<kSwapdKV, AtomLayoutCols, AtomLayoutKeys>;
  // S^T = K Q^T and dP^T = V dO^T: both operands from shared memory, head dim contiguous (K-major).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<_64, Int<kSwapdKV ? kBlockM / kMmaWarpgroups : kBlockM>, HeadDim>>(),
      AtomLayoutSdP{}));
  // dV += P^T dO and dK += dS^T Q: A from registers, B = dO^T / Q^T read transposed (MN-major).
  using TiledMmadKVRegs = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, HeadDim, BlockM>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayoutKeys{}));
  // Swapped: dV^T += dO^T P and dK^T += Q^T dS, A = dO^T / Q^T read transposed (MN-major), B = P /
  // dS from shared memory (queries contiguous: K-major); M = the head dim in 64-row steps.
  using TiledMmadKVSwapped = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, KeysPerWarpgroup, BlockM>, GMMA::Major::MN,
                           GMMA::Major::K>(),
      AtomLayoutCols{}));
  using TiledMmadKV = std::conditional_t<kSwapdKV, TiledMmadKVSwapped, TiledMmadKVRegs>;
  // dQ = dS K: queries x head dim, split over the warpgroups by 64 query rows (d64: 128 rows) or by
  // halves of the head dim (d128: 64 rows). A = dS stored queries-contiguous (MN-major), B = K^T.
  // Swapped at d256, dQ is formed in two column chunks one after the other (a warpgroup's 64 x 128
  // at once would sit beside dK^T and dV^T's 128 registers).
  static constexpr int kDqWarpgroupsM = kBlockM / 64;
  static constexpr int kDqWarpgroupsN = kMmaWarpgroups / kDqWarpgroupsM;
  static_assert(kDqWarpgroupsM * kDqWarpgroupsN == kMmaWarpgroups, "the dQ tile splits over the warpgroups");
  static constexpr int kDqChunks = kSwapdKV && kHeadDim > 192 ? 2 : 1;
  static constexpr int kDqWidth = kHeadDim / kDqWarpgroupsN / kDqChunks;  // one warpgroup's wgmma N
  using TileQDChunk = Shape<BlockM, Int<kHeadDim / kDqChunks>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kDqWidth>, BlockN>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      Layout<Shape<Int<kDqWarpgroupsM>, Int<kDqWarpgroupsN>, _1>>{}));
  // One wgmma per K step as wide as each warpgroup's share (d96: N = 48, an extended shape).
  static_assert(decltype(size<1>(typename TiledMmadQ::Shape_MNK{}))::value == kDqWidth,
                "a dQ wgmma shape CuTe did not select: CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED must precede cute/");

  // Swizzled rows (the forward's atoms): what TMA writes and wgmma reads without bank conflicts.
  // K is also dQ's B operand, whose columns (the head dim) the warpgroups split: its atom must not
  // straddle the split, so K's is the widest atom that the per-warpgroup width fills (d96: 48
  // columns, the 32-byte atom, FlashAttention-3's choice; else the same as Q's).
  using SmemAtom = decltype(smem_atom<Element, kHeadDim>());
  using SmemAtomK = decltype(smem_atom<Element, kDqWidth>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim, Stages>{}));
  using SmemLayoutdO = SmemLayoutQ;
  // Q and dO (queries, dims, stage) viewed as (dims, queries, stage): the same bytes.
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<HeadDim, BlockM, Stages>{}, Step<_2, _1, _3>{})));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BlockN, HeadDim>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim>{}));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<HeadDim, BlockN>{}, Step<_2, _1>{})));
  // dS (queries, keys, buffer), queries contiguous: the consumers write it from dS^T's accumulators
  // (adjacent query pairs) and the dQ wgmma reads it as an MN-major A. kDsBuffers buffers.
  // Swapped, P has the same layout, and dS^T / P^T (keys, queries) are dK^T's / dV^T's B operands.
  using DsBuffers = Int<kDsBuffers>;
  using SmemLayoutdS =
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<BlockM, BlockN, DsBuffers>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<BlockN, BlockM, DsBuffers>{}, Step<_2, _1, _3>{})));

  // Global q/k/v/dO as (seqlen, head dim, heads, batch), unit stride on the head dim.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{},
                                          GmemStride{}));
  using TmaQdO = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                        Shape<BlockM, HeadDim>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutK{}, Shape<BlockN, HeadDim>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutV{}, Shape<BlockN, HeadDim>{}, _1{}));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesRows = kBlockM * sizeof(float);  // lse2 or delta of one query block
  static constexpr uint32_t kTmaBytesStage = 2 * kTmaBytesQ + 2 * kTmaBytesRows;
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  using ClusterShape = Shape<_1, _1, _1>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> dout;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
    // P (swapped only; unswapped it is dV's register operand and this holds nothing).
    alignas(kSwapdKV ? 1024 : 16) cute::array_aligned<Element, kSwapdKV ? cosize_v<SmemLayoutdS> : 8> p;
    alignas(16) float lse2[kStages][kBlockM];
    // The soft-cap's derivative of each consumer thread's scores, two per word, [pair][thread]
    // (consecutive threads, consecutive banks): kept here across dP^T's GEMM, not in registers.
    __half2 cap_grad[kBlockN * kBlockM / kMmaThreads / 2][kMmaThreads];
    alignas(16) float delta[kStages][kBlockM];
    cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename Pipeline::SharedStorage pipeline;
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KB of shared memory per block");
};

// The kernel's one parameter (__grid_constant__: TMA descriptors must not live in a local copy).
template <typename Traits>
struct BwdKernelParams {
  AttentionBackwardParams attn;
  typename Traits::TmaQdO tma_q;
  typename Traits::TmaQdO tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  const float* lse2;  // the workspace's parts (flash_bwd_sm90.h BwdWorkspace)
  const float* delta;
  float* dq_accum;
  int* order;  // deterministic mode only, else nullptr
  int64_t seqlen_q_rounded;
};

namespace bwd {

inline constexpr float kLog2e = 1.4426950408889634f;
// Named barriers of the MMA warpgroups (ids counted after CUTLASS's reserved ones).
inline constexpr uint32_t kBarrierDs = 0;     // dS of a query block is in shared memory
inline constexpr uint32_t kBarrierOrder = 1;  // deterministic mode: this key block's turn
inline constexpr uint32_t kBarrierDsFree = 2;  // one dS/P buffer (d256): the last block's readers are done

// Query heads per key/value head.
__device__ __forceinline__ int group_size(const AttentionParams& p) {
  return static_cast<int>(p.num_heads / (p.num_heads_k > 0 ? p.num_heads_k : p.num_heads));
}

}  // namespace bwd

}  // namespace attn_export::cuda::sm90
