// The Hopper backward: dQ, dK, dV of softmax(cap(scale * Q K^T) + masks) V, for one (batch,
// key/value head, block of 128 keys, 64 swapped) per thread block, on sm_90a's own instructions. Three
// kernels, all O(L) in extra memory (FlashAttention-2/3's structure):
//
//   1. prepare: delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf for rows that see no key),
//      both into padded workspace rows that 1-D bulk copies (cp.async.bulk) read per query block.
//   2. flash_bwd_sm90_kernel (warp specialized, FlashAttention-3's design): warpgroup 0 produces,
//      one thread loading K and V of the block once, then Q, dO, lse2 and delta of every query
//      block that can see these keys into a 2-stage cutlass::PipelineTmaAsync ring. Warpgroups 1
//      and 2 own 64 keys each:
//          S^T = K Q^T, dP^T = V dO^T         wgmma, both operands in shared memory
//          P^T = exp2(S^T scale log2e + masks - lse2),  dS^T = P^T (dP^T - delta) (1 - t^2 capped)
//          dV += P^T dO,  dK += dS^T Q         wgmma, A from registers (the accumulators, 16-bit)
//          dQ(block) += dS K                   dS through shared memory, wgmma, fp32 atomics
//      dK and dV stay in registers across every query block and across the query heads of a
//      grouped-query head (the block loops over them), so the group's sum needs no second pass.
//      Swapped (kSwapdKV, head dims 192 and 256; consume_swapped): 64 keys per block,
//          S^T, dP^T as above, the warpgroups splitting the queries
//          P^T, dS^T -> shared memory;  dV^T += dO^T P, dK^T += Q^T dS   wgmma, both in shared memory
//          dQ(block) += dS K (at d256 in two column chunks)
//   3. convert: dQ = scale * accumulated dQ in the element type.
//
// Deterministic mode (AttentionBackwardParams::deterministic): the key blocks of one (batch,
// head) add to a query block's dQ in key-block order, each waiting for its predecessor's turn
// (an int per query block), with plain read-modify-writes instead of atomics. With a sliding
// window the key blocks visiting a query block are a range, not a prefix (dq_turn).
//
// Files by role: flash_bwd_sm90_prepare.cuh (1), flash_bwd_sm90_producer.cuh and
// flash_bwd_sm90_consumer.cuh (2's warpgroups), flash_bwd_sm90_epilogue.cuh (2's dQ adds, dK/dV
// stores, the deterministic turns), flash_bwd_sm90_convert_dq.cuh (3), the tiles and layouts in
// flash_bwd_sm90_traits.cuh, which tiles a block visits in ../block_bounds.h; here the kernel that
// assigns the roles and the host launcher.
//
// Semantics are the sm80 backward's (flash_bwd_kernel.cuh) through the same ScoreMask and
// SoftCap. dK/dV keep the binding's contract (per query head, the binding sums each group): the
// group's sum is written at its first query head and zeros at the others.
//
// Not yet here (docs/cuda.md "Hopper backward"): a separate dQ writer warp with TMA reduce-adds,
// overlap of the S and dP GEMMs with the softmax math, a 2-CTA cluster. And nothing here has
// run: it is compiled and its SASS checked offline only.
#pragma once

// Before CuTe's first inclusion: the traits' dQ shape at d96 (wgmma N = 48) needs it.
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED 1
#endif

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../launch.h"
#include "flash_bwd_sm90.h"
#include "flash_bwd_sm90_consumer.cuh"
#include "flash_bwd_sm90_convert_dq.cuh"
#include "flash_bwd_sm90_epilogue.cuh"
#include "flash_bwd_sm90_prepare.cuh"
#include "flash_bwd_sm90_producer.cuh"
#include "flash_bwd_sm90_traits.cuh"
#include "flash_fwd_sm90_kernel.cuh"  // CutlassElement, make_tma

namespace attn_export::cuda::sm90 {
namespace bwd {

template <typename Traits, typename RawElement, bool kIsCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdKernelParams<Traits> kp) {
#if defined(ATTN_EXPORT_SM90_DEVICE_PASS)
  using T = Traits;
  using Pipeline = typename T::Pipeline;
  extern __shared__ __align__(1024) unsigned char attn_export_sm90_bwd_smem[];
  auto& shared = *reinterpret_cast<typename T::SharedStorage*>(attn_export_sm90_bwd_smem);
  const int warpgroup = threadIdx.x / 128;
  const int n_block = blockIdx.x, kv = blockIdx.y, b = blockIdx.z;
  if (skip_padded_key_block<T, RawElement, kIsCausal>(kp, n_block, kv, b, reinterpret_cast<int*>(attn_export_sm90_bwd_smem))) {
    return;
  }

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = T::kTmaBytesStage;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;  // the thread that issues the loads
  pipe_params.num_consumers = T::kMmaThreads;
  if (threadIdx.x == 0) {
    shared.barrier_kv.init(1);
    prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(kp.tma_do.get_tma_descriptor());
    prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
  }
  Pipeline pipe(shared.pipeline, pipe_params, typename T::ClusterShape{});
  __syncthreads();  // barriers initialized before anyone waits on them

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x / 32 == 0 && cute::elect_one_sync()) {
      produce<T, kIsCausal>(kp, shared, pipe, n_block, kv, b);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    if constexpr (T::kSwapdKV) {
      consume_swapped<T, RawElement, kIsCausal>(kp, shared, pipe, n_block, kv, b);
    } else {
      consume<T, RawElement, kIsCausal>(kp, shared, pipe, n_block, kv, b);
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // not the sm_90a pass: as the forward (flash_fwd_sm90_kernel.cuh), fail loudly
#endif
}

}  // namespace bwd

// Host launcher: the workspace's parts, the prepare kernel, the TMA descriptors, one block per
// (kBlockN keys, key/value head, batch), then the dQ conversion. The caller checked supports_backward().
template <typename Element, int kHeadDim, bool kIsCausal>
cudaError_t run_flash_bwd_sm90_(const AttentionBackwardParams& p, void* workspace, cudaStream_t stream) {
  using T = BwdTraits<typename CutlassElement<Element>::type, kHeadDim>;
  if (!supports_backward(p) || p.head_dim != kHeadDim || workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  const BwdWorkspace w = bwd_workspace(p);
  auto* bytes = static_cast<unsigned char*>(workspace);
  float* lse2 = reinterpret_cast<float*>(bytes);
  float* delta = reinterpret_cast<float*>(bytes + w.lse2);
  float* dq = reinterpret_cast<float*>(bytes + w.lse2 + w.delta);
  int* order = p.deterministic ? reinterpret_cast<int*>(bytes + w.lse2 + w.delta + w.dq) : nullptr;
  const int64_t rounded = round_up(p.seqlen_q, T::kBlockM);
  if (cudaError_t err = cudaMemsetAsync(dq, 0, w.dq + w.order, stream); err != cudaSuccess) {
    return err;
  }
  const int64_t rows = p.batch * p.num_heads * rounded;
  cudaError_t err = launch_kernel(bwd::flash_bwd_sm90_prepare<Element>, dim3(static_cast<unsigned>((rows + 7) / 8)),
                                  dim3(256), 0, stream, p, lse2, delta, rounded);
  if (err != cudaSuccess) {
    return err;
  }
  const int64_t heads_k = p.num_heads_k > 0 ? p.num_heads_k : p.num_heads;
  const BwdKernelParams<T> kp{
      p,
      make_tma<T>(p.q, p.seqlen_q, p.head_dim, p.num_heads, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride,
                  take<0, 2>(typename T::SmemLayoutQ{}), Shape<typename T::BlockM, typename T::HeadDim>{}),
      make_tma<T>(p.grad_out, p.seqlen_q, p.head_dim_v, p.num_heads, p.batch, p.grad_out_row_stride,
                  p.grad_out_head_stride, p.grad_out_batch_stride, take<0, 2>(typename T::SmemLayoutdO{}),
                  Shape<typename T::BlockM, typename T::HeadDim>{}),
      make_tma<T>(p.k, p.seqlen_k, p.head_dim, heads_k, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride,
                  typename T::SmemLayoutK{}, Shape<typename T::BlockN, typename T::HeadDim>{}),
      make_tma<T>(p.v, p.seqlen_k, p.head_dim_v, heads_k, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride,
                  typename T::SmemLayoutV{}, Shape<typename T::BlockN, typename T::HeadDim>{}),
      lse2, delta, dq, order, rounded,
  };
  const dim3 grid(static_cast<unsigned>((p.seqlen_k + T::kBlockN - 1) / T::kBlockN), static_cast<unsigned>(heads_k),
                  static_cast<unsigned>(p.batch));
  err = launch_kernel(bwd::flash_bwd_sm90_kernel<T, Element, kIsCausal>, grid, dim3(T::kThreads), T::kSmemBytes,
                      stream, kp);
  if (err != cudaSuccess) {
    return err;
  }
  constexpr int kThreads = 256;
  const int64_t blocks = (p.batch * p.num_heads * p.seqlen_q * (p.head_dim / 2) + kThreads - 1) / kThreads;
  return launch_kernel(bwd::flash_bwd_sm90_convert_dq<Element>, dim3(static_cast<unsigned>(blocks < 65536 ? blocks : 65536)),
                       dim3(kThreads), 0, stream, p, static_cast<const float*>(dq), rounded);
}

}  // namespace attn_export::cuda::sm90
