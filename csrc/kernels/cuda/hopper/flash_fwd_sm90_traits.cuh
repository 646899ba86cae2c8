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

template <typename Element_, int kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "wgmma: K steps of 16, N up to 256");
  static constexpr int kBlockM = 128;
  // Key tiles: 128 keys up to head dim 128, where the scores (64 floats per consumer thread) and
  // O (up to 64) fit the consumers' 240 registers; 64 above, where O alone is up to 128 floats.
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  // The K/V ring: 3 slots where 3 fit beside Q (head dim <= 64: 16 KB per K or V tile), else 2
  // (d128: 32 KB + 2 x 2 x 32 KB; d256: 64 KB + 2 x 2 x 32 KB).
  static constexpr int kStages = kHeadDim <= 64 ? 3 : 2;
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
