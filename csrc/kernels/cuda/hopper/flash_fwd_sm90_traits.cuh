// Tiles, shared-memory layouts, tensor-core operations and copy descriptors of the Hopper
// forward, in one place (the sm80 kernels' kernel_traits.h, for flash_fwd_sm90_kernel.cuh).
//
// One thread block computes kBlockM = 128 query rows of one (batch, head): warpgroup 0 is the
// producer (one thread issues the TMA loads), warpgroups 1 and 2 the consumers, 64 rows each
// (wgmma's M). Keys and values stream through a kStages-deep ring of kBlockN-row tiles, sized
// per head dim (and causality) by fwd_tile().
#pragma once

// CuTe keeps the wgmma shapes with N not in {8, 16, 32, 64, 96, 128, 192, 256} (the tile table's
// 80-, 112- and 176-key tiles) behind this switch; it must precede CuTe's first inclusion in the
// unit (FwdTraits asserts that the full-width shapes were selected).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED 1
#endif

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cstdint>

#include "../../../attention_params.h"
#include "flash_fwd_sm90.h"

namespace attn_export::cuda::sm90 {

using namespace cute;

// The widest swizzled shared-memory atom whose rows a head dim fills: 128-byte rows (64 two-byte
// elements) where the head dim is a multiple of 64, else 64-byte (32) or 32-byte (16) ones.
template <typename Element, int kHeadDim>
auto smem_atom() {
  if constexpr (kHeadDim % 64 == 0) {
    return GMMA::Layout_K_SW128_Atom<Element>{};
  } else if constexpr (kHeadDim % 32 == 0) {
    return GMMA::Layout_K_SW64_Atom<Element>{};
  } else {
    return GMMA::Layout_K_SW32_Atom<Element>{};
  }
}

// The tile sizes and scheduling switches: fwd_tile() in flash_fwd_sm90.h.
template <typename Element_, int kHeadDim_, bool kIsCausal_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kIsCausal = kIsCausal_;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "wgmma: K steps of 16, N up to 256");
  static constexpr FwdTile kTile = fwd_tile(kHeadDim, kIsCausal);
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = kTile.block_n;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "key tiles: K steps of 16 for P V, N up to 256 for Q K^T");
  static constexpr int kStages = kTile.stages;
  static constexpr bool kPingPong = kTile.ping_pong;
  static constexpr bool kOverlap = kTile.overlap;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  // setmaxnreg: the producer gives up registers, the consumers take them (24 * 128 + 2 * 240 * 128
  // = 64512 <= 65536 per SM, one block per SM).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using Stages = Int<kStages>;
  using WarpgroupM = Int<kBlockM / kConsumerWarpgroups>;

  // The consumers' warpgroups split the rows (M); each issues wgmma of its 64 rows.
  using AtomLayout = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  // S = Q K^T: both operands from shared memory, K-major (the head dim is contiguous in both).
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<WarpgroupM, BlockN, HeadDim>>(), AtomLayout{}));
  // O += P V: P from registers (the S accumulators, converted), V from shared memory read
  // transposed (MN-major: V's head dim, the GEMM's N, is contiguous).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<WarpgroupM, HeadDim, BlockN>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      AtomLayout{}));
  // One wgmma per K step and warpgroup, as wide as the tile (not split into narrower ones).
  static_assert(decltype(size<1>(typename TiledMmaQK::Shape_MNK{}))::value == kBlockN &&
                    decltype(size<1>(typename TiledMmaPV::Shape_MNK{}))::value == kHeadDim,
                "a wgmma shape CuTe did not select: CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED must precede cute/");

  // Swizzled rows: what TMA writes and wgmma reads without bank conflicts.
  using SmemAtom = decltype(smem_atom<Element, kHeadDim>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim, Stages>{}));
  using SmemLayoutV = SmemLayoutK;
  // V (keys, dims, stage) viewed as V^T (dims, keys, stage): the same bytes.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<HeadDim, BlockN, Stages>{}, Step<_2, _1, _3>{})));

  // Global q/k/v as (seqlen, head dim, heads, batch), unit stride on the head dim.
  using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemShape{},
                                          GmemStride{}));
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, SmemLayoutQ{}, Shape<BlockM, HeadDim>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutK{}),
                                       Shape<BlockN, HeadDim>{}, _1{}));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  using ClusterShape = Shape<_1, _1, _1>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> v;
    cutlass::arch::ClusterTransactionBarrier barrier_q;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    int key_tiles[2];  // the block's key tiles [begin, end), found before the role split (no TMA writes it)
  };
  static constexpr size_t kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "the tiles must fit sm_90's 227 KB of shared memory per block");
};

// The kernel's one parameter (passed as __grid_constant__: the TMA descriptors must live in
// parameter, constant or global memory, never in a local copy).
template <typename Traits>
struct FwdKernelParams {
  AttentionParams attn;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
};

}  // namespace attn_export::cuda::sm90
