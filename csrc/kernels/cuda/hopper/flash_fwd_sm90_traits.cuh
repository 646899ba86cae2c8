// Tiles, shared-memory layouts, tensor-core operations and copy descriptors of the Hopper
// forward, in one place (the sm80 kernels' kernel_traits.h, for flash_fwd_sm90_kernel.cuh).
//
// One thread block computes kBlockM = 128 query rows of one (batch, head): warpgroup 0 is the
// producer (one thread issues the TMA loads), warpgroups 1 and 2 the consumers, 64 rows each
// (wgmma's M). Keys and values stream through a kStages-deep ring of kBlockN-row tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cstdint>

#include "../../../attention_params.h"

namespace attn_export::cuda::sm90 {

using namespace cute;

template <typename Element_, int kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;
  // 128-key tiles at both head dims: the scores (64 floats per consumer thread) and O (32 or 64)
  // fit the consumers' 240 registers; d128's K/V ring is 2 x 2 x 32 KB beside Q's 32 KB.
  static constexpr int kBlockN = 128;
  static constexpr int kStages = kHeadDim <= 64 ? 3 : 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (kConsumerWarpgroups + 1);
  // setmaxnreg: the producer gives up registers, the consumers take them (24 * 128 + 2 * 240 * 128
  // = 64512 <= 65536 per SM, one block per SM).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kHeadDim % 64 == 0, "the 128-byte swizzle atom holds 64 two-byte elements per row");

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

  // 128-byte swizzled rows: what TMA writes and wgmma reads without bank conflicts.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<BlockM, HeadDim>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<BlockN, HeadDim, Stages>{}));
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
