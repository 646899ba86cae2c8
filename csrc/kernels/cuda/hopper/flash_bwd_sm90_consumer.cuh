// The Hopper backward's consumers (flash_bwd_sm90_kernel.cuh): warpgroups 1 and 2 walk the query
// blocks the producer loads and, per block, form P^T and dS^T from S^T = K Q^T and dP^T = V dO^T,
// add P^T dO and dS^T Q into dV and dK (registers, across the whole group of query heads) and
// add dS K into the workspace's dQ; at the end they store dK and dV (flash_bwd_sm90_epilogue.cuh).
// consume: keys as wgmma rows, dK/dV's A operands straight from the accumulators; consume_swapped
// (kSwapdKV, head dims 192 and 256): P^T and dS^T through shared memory, dK^T and dV^T.
#pragma once

#include "../block_bounds.h"
#include "../element.cuh"
#include "flash_bwd_sm90_epilogue.cuh"
#include "flash_bwd_sm90_traits.cuh"
#include "flash_fwd_sm90_kernel.cuh"  // probabilities_as_operand, warpgroup_gemm

namespace attn_export::cuda::sm90 {
namespace bwd {

// A shared-memory buffer as a tensor of the given layout.
template <typename Storage, typename Layout>
__device__ __forceinline__ auto smem_tensor(Storage& storage, Layout layout) {
  return make_tensor(make_smem_ptr(storage.data()), layout);
}

// A consumer's three GEMMs (S^T and dP^T; dK and dV; dQ) and this thread's slice of each (tid:
// within the consumers).
template <typename T>
struct ConsumerMmas {
  typename T::TiledMmaSdP sdp;
  typename T::TiledMmadKV dkv;
  typename T::TiledMmadQ dq;
  decltype(sdp.get_thread_slice(0)) thr_sdp;
  decltype(dkv.get_thread_slice(0)) thr_dkv;
  decltype(dq.get_thread_slice(0)) thr_dq;

  __device__ explicit ConsumerMmas(int tid)
      : thr_sdp(sdp.get_thread_slice(tid)), thr_dkv(dkv.get_thread_slice(tid)), thr_dq(dq.get_thread_slice(tid)) {}
};

// The operands of the S^T = K Q^T and dP^T = V dO^T GEMMs (all in shared memory; Q and dO per
// stage) as this thread's share of them sees them, and the (key, query) of each of its scores:
// {K, Q, V, dO, coordinates}, the same in both consumers.
template <typename T, typename ThrMma>
__device__ __forceinline__ auto score_operands(const ThrMma& thr_sdp, typename T::SharedStorage& shared) {
  return cute::make_tuple(thr_sdp.partition_fragment_A(smem_tensor(shared.k, typename T::SmemLayoutK{})),
                          thr_sdp.partition_fragment_B(smem_tensor(shared.q, typename T::SmemLayoutQ{})),
                          thr_sdp.partition_fragment_A(smem_tensor(shared.v, typename T::SmemLayoutV{})),
                          thr_sdp.partition_fragment_B(smem_tensor(shared.dout, typename T::SmemLayoutdO{})),
                          thr_sdp.partition_C(make_identity_tensor(typename T::TileKQ{})));
}

// S^T -> P^T in place, before dP^T's GEMM so that the masks' state and dP^T's accumulators are
// never live together (a consumer has 240 registers). With a soft-cap, also its derivative
// 1 - t^2 per score into shared memory, `cap_grad` [pair][thread] at this thread's column, two
// per word (fp16: ~5e-4 relative, below the rounding dS gets as the dK/dQ GEMMs' 16-bit
// operand). coord: (key, query) of each value.
template <typename T, bool kIsCausal, typename TS, typename TC, typename TG>
__device__ __forceinline__ void probabilities(const AttentionParams& p, TS& s, TG& cap_grad, const TC& coord,
                                              const float* lse2, int b, int h, int n0, int m0) {
  const float scale = static_cast<float>(p.scale);
  const device::SoftCap<float> softcap(p);
  const device::ScoreMask<float> mask(p, b, h, kLog2e);
  const int shift = kIsCausal ? static_cast<int>(p.causal_shift()) : 0;
  const bool masked = mask.reads_memory() || n0 + T::kBlockN > p.seqlen_k || m0 + T::kBlockM > p.seqlen_q ||
      (kIsCausal && bounds::causal_edge_in_tile(p, m0, m0 + T::kBlockM - 1, n0, T::kBlockN, shift));
  CUTE_UNROLL
  for (int i = 0; i < size(s); i += 2) {
    float prob[2], grad[2] = {1.f, 1.f};
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      const int key = get<0>(coord(i + j)), query = get<1>(coord(i + j));
      float x = s(i + j) * (scale * kLog2e);
      if (softcap.on) {
        const float t = softcap.tanh_of(s(i + j) * scale);
        x = softcap.cap * t * kLog2e;
        grad[j] = 1.f - t * t;
      }
      if (masked) {
        x = mask.apply(x, m0 + query, n0 + key);
      }
      prob[j] = device::fast_exp2(x - lse2[query]);
    }
    s(i) = prob[0];
    s(i + 1) = prob[1];
    if (softcap.on) {
      cap_grad[i / 2 * T::kMmaThreads] = __floats2half2_rn(grad[0], grad[1]);
    }
  }
}

// dP^T -> dS^T = P^T (dP^T - delta) (1 - t^2) in place; prob: P^T in 16 bits, the accumulators' layout.
template <typename T, typename TP, typename TS, typename TC, typename TG>
__device__ __forceinline__ void score_gradients(const AttentionParams& p, const TP& prob, TS& dp, const TG& cap_grad,
                                                const TC& coord, const float* delta) {
  const bool capped = p.softcap > 0;
  CUTE_UNROLL
  for (int i = 0; i < size(dp); i += 2) {
    const float2 grad = capped ? __half22float2(cap_grad[i / 2 * T::kMmaThreads]) : make_float2(1.f, 1.f);
    dp(i) = static_cast<float>(prob(i)) * (dp(i) - delta[get<1>(coord(i))]) * grad.x;
    dp(i + 1) = static_cast<float>(prob(i + 1)) * (dp(i + 1) - delta[get<1>(coord(i + 1))]) * grad.y;
  }
}

// dS^T's registers (ds, in the accumulator's layout) -> dS in shared memory (ds_smem: this
// thread's positions in the buffer of this stage), then dQ(block) = dS K into the workspace. The
// fence makes the ordinary stores visible to wgmma (the async proxy), the barrier to the other
// warpgroup, whose rows of dS this thread's share of the GEMM reads.
template <typename T, typename TS, typename TD, typename TA, typename TB, typename TC>
__device__ __forceinline__ void dq_step(const BwdKernelParams<T>& kp, typename T::TiledMmadQ& mma_dq, const TS& ds,
                                        TD&& ds_smem, TA&& tdQrdS, const TB& tdQrK, const TC& cdQ, int64_t bh, int m,
                                        int rank) {
  copy(ds, ds_smem);
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierDs);
  Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::TileQD{});
  warpgroup_gemm<true>(mma_dq, tdQrdS, tdQrK, tdQrdQ);
  add_dq<T>(kp, tdQrdQ, cdQ, bh, m, rank);
}

template <typename T, typename RawElement, bool kIsCausal>
__device__ void consume(const BwdKernelParams<T>& kp, typename T::SharedStorage& shared, typename T::Pipeline& pipe,
                        int n_block, int kv, int b) {
  const AttentionBackwardParams& p = kp.attn;
  const int tid = threadIdx.x - 128;  // within the consumers
  const int group = group_size(p);
  ConsumerMmas<T> mmas(tid);
  auto& [mma_sdp, mma_dkv, mma_dq, thr_sdp, thr_dkv, thr_dq] = mmas;
  auto [tSrK, tSrQ, tdPrV, tdPrdO, cS] = score_operands<T>(thr_sdp, shared);
  Tensor tdVrdO = thr_dkv.partition_fragment_B(smem_tensor(shared.dout, typename T::SmemLayoutQt{}));
  Tensor tdKrQ = thr_dkv.partition_fragment_B(smem_tensor(shared.q, typename T::SmemLayoutQt{}));
  Tensor tdQrdS = thr_dq.partition_fragment_A(smem_tensor(shared.ds, typename T::SmemLayoutdS{}));
  Tensor tdQrK = thr_dq.partition_fragment_B(smem_tensor(shared.k, typename T::SmemLayoutKt{}));
  Tensor sdSt = smem_tensor(shared.ds, typename T::SmemLayoutdSt{});
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(typename T::TileQD{}));
  Tensor tdVrdV = partition_fragment_C(mma_dkv, typename T::TileKD{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, typename T::TileKD{});
  clear(tdVrdV);
  clear(tdKrdK);
  const int n0 = n_block * T::kBlockN;
  const bounds::TileRange seen_by = bounds::query_blocks<T::kBlockM, T::kBlockN, kIsCausal>(p, n0);
  const int m_begin = seen_by.begin, m_blocks = seen_by.end;

  shared.barrier_kv.wait(0);
  typename T::PipelineState read;
#pragma unroll 1
  for (int g = 0; g < group; ++g) {
    const int h = kv * group + g;
#pragma unroll 1
    for (int m = m_begin; m < m_blocks; ++m) {
      Tensor tSrS = partition_fragment_C(mma_sdp, typename T::TileKQ{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, typename T::TileKQ{});
      pipe.consumer_wait(read);
      const int s = read.index();  // the Q/dO stage, and the dS buffer (both alternate per query block)
      warpgroup_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, s), tSrS);
      __half2* cap_grad = &shared.cap_grad[0][tid];
      probabilities<T, kIsCausal>(p, tSrS, cap_grad, cS, shared.lse2[s], b, h, n0, m * T::kBlockM);
      warpgroup_gemm<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, s), tdPrdP);
      // P^T in 16 bits (dV's A operand) before dS^T: dS^T reads the rounded P^T, as the plain
      // 16-bit computation does, and P^T never lives in fp32 beside dP^T (240 registers).
      Tensor tPrP = probabilities_as_operand<typename T::Element>(tSrS);
      score_gradients<T>(p, make_tensor(tPrP.data(), tSrS.layout()), tdPrdP, cap_grad, cS, shared.delta[s]);
      Tensor tdSrdS = probabilities_as_operand<typename T::Element>(tdPrdP);
      warpgroup_gemm<false>(mma_dkv, tPrP, tdVrdO(_, _, _, s), tdVrdV);
      warpgroup_gemm<false>(mma_dkv, tdSrdS, tdKrQ(_, _, _, s), tdKrdK);
      pipe.consumer_release(read);
      ++read;
      dq_step<T>(kp, mma_dq, make_tensor(tdSrdS.data(), tdPrdP.layout()), thr_sdp.partition_C(sdSt(_, _, s)),
                 tdQrdS(_, _, _, s), tdQrK, cdQ, static_cast<int64_t>(b) * p.num_heads + h, m,
                 dq_turn<T, kIsCausal>(p, m, n_block));
    }
  }
  Tensor cdKV = thr_dkv.partition_C(make_identity_tensor(typename T::TileKD{}));
  store_dkdv<T, RawElement>(p, tdKrdK, tdVrdV, cdKV, n0, kv, b, group);
}

// ---- The swapped path (kSwapdKV: head dims 192 and 256).

// P^T and dS^T (16 bits, the accumulators' layout) into this block's buffers, visible to wgmma
// and to the other warpgroup. With one buffer, first wait until both warpgroups have finished
// the previous block's GEMMs that read it.
template <typename T, typename TP, typename TS, typename TPs, typename TSs>
__device__ __forceinline__ void publish_pds(const TP& prob, const TS& ds, TPs&& p_smem, TSs&& ds_smem) {
  if constexpr (T::kDsBuffers == 1) {
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierDsFree);
  }
  copy(prob, p_smem);
  copy(ds, ds_smem);
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierDs);
}

// dV^T += dO^T P and dK^T += Q^T dS of one query block (A: dO^T, Q^T of its stage; B: P, dS).
template <typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void dkv_swapped_step(TiledMma& mma, TA dot, const TB& p, TC& dv, TA qt, const TB& ds,
                                                 TC& dk) {
  warpgroup_gemm<false>(mma, dot, p, dv);
  warpgroup_gemm<false>(mma, qt, ds, dk);
}

// dQ(block) = dS K in kDqChunks column chunks, one after the other, each added as it is formed
// (one deterministic turn for all of them). ds: dS's descriptors; sKt: K^T (head dim, keys).
template <typename T, typename TA, typename TK>
__device__ __forceinline__ void dq_chunks(const BwdKernelParams<T>& kp, typename T::TiledMmadQ& mma_dq, TA& ds,
                                          const TK& sKt, int64_t bh, int m, int rank) {
  using Chunk = typename T::TileQDChunk;
  auto thr_dq = mma_dq.get_thread_slice(threadIdx.x - 128);
  int* turn = dq_turn_wait(kp, bh, m, rank);
  CUTE_UNROLL
  for (int c = 0; c < T::kDqChunks; ++c) {
    Tensor tdQrK = thr_dq.partition_fragment_B(
        local_tile(sKt, Shape<decltype(get<1>(Chunk{})), typename T::BlockN>{}, make_coord(c, _0{})));
    Tensor cdQ =
        thr_dq.partition_C(local_tile(make_identity_tensor(typename T::TileQD{}), Chunk{}, make_coord(_0{}, c)));
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Chunk{});
    warpgroup_gemm<true>(mma_dq, ds, tdQrK, tdQrdQ);
    add_dq_values<T>(dq_block(kp, bh, m), tdQrdQ, cdQ, turn != nullptr);
  }
  dq_turn_pass<T>(turn, rank);
}

template <typename T, typename RawElement, bool kIsCausal>
__device__ void consume_swapped(const BwdKernelParams<T>& kp, typename T::SharedStorage& shared,
                                typename T::Pipeline& pipe, int n_block, int kv, int b) {
  const AttentionBackwardParams& p = kp.attn;
  const int tid = threadIdx.x - 128;
  ConsumerMmas<T> mmas(tid);
  auto& [mma_sdp, mma_dkv, mma_dq, thr_sdp, thr_dkv, thr_dq] = mmas;
  auto [tSrK, tSrQ, tdPrV, tdPrdO, cS] = score_operands<T>(thr_sdp, shared);
  Tensor tdVrdOt = thr_dkv.partition_fragment_A(smem_tensor(shared.dout, typename T::SmemLayoutQt{}));
  Tensor tdKrQt = thr_dkv.partition_fragment_A(smem_tensor(shared.q, typename T::SmemLayoutQt{}));
  Tensor tdVrP = thr_dkv.partition_fragment_B(smem_tensor(shared.p, typename T::SmemLayoutdSt{}));
  Tensor tdKrdS = thr_dkv.partition_fragment_B(smem_tensor(shared.ds, typename T::SmemLayoutdSt{}));
  Tensor tdQrdS = thr_dq.partition_fragment_A(smem_tensor(shared.ds, typename T::SmemLayoutdS{}));
  Tensor sKt = smem_tensor(shared.k, typename T::SmemLayoutKt{});
  Tensor sPt = smem_tensor(shared.p, typename T::SmemLayoutdSt{});
  Tensor sdSt = smem_tensor(shared.ds, typename T::SmemLayoutdSt{});
  Tensor tdVrdV = partition_fragment_C(mma_dkv, typename T::TileDKV{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, typename T::TileDKV{});
  clear(tdVrdV);
  clear(tdKrdK);
  const int n0 = n_block * T::kBlockN, group = group_size(p);
  const bounds::TileRange seen_by = bounds::query_blocks<T::kBlockM, T::kBlockN, kIsCausal>(p, n0);
  const int m_begin = seen_by.begin, m_blocks = seen_by.end;
  shared.barrier_kv.wait(0);
  typename T::PipelineState read;
#pragma unroll 1
  for (int step = 0; step < group * (m_blocks - m_begin); ++step) {
    const int h = kv * group + step / (m_blocks - m_begin), m = m_begin + step % (m_blocks - m_begin);
    Tensor tSrS = partition_fragment_C(mma_sdp, typename T::TileKQ{});
    Tensor tdPrdP = partition_fragment_C(mma_sdp, typename T::TileKQ{});
    pipe.consumer_wait(read);
    const int s = read.index(), buf = s % T::kDsBuffers;
    warpgroup_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, s), tSrS);
    __half2* cap_grad = &shared.cap_grad[0][tid];
    probabilities<T, kIsCausal>(p, tSrS, cap_grad, cS, shared.lse2[s], b, h, n0, m * T::kBlockM);
    warpgroup_gemm<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, s), tdPrdP);
    Tensor tPrP = probabilities_as_operand<typename T::Element>(tSrS);
    score_gradients<T>(p, make_tensor(tPrP.data(), tSrS.layout()), tdPrdP, cap_grad, cS, shared.delta[s]);
    Tensor tdSrdS = probabilities_as_operand<typename T::Element>(tdPrdP);
    publish_pds<T>(make_tensor(tPrP.data(), tSrS.layout()), make_tensor(tdSrdS.data(), tdPrdP.layout()),
                   thr_sdp.partition_C(sPt(_, _, buf)), thr_sdp.partition_C(sdSt(_, _, buf)));
    dkv_swapped_step(mma_dkv, tdVrdOt(_, _, _, s), tdVrP(_, _, _, buf), tdVrdV, tdKrQt(_, _, _, s),
                     tdKrdS(_, _, _, buf), tdKrdK);
    pipe.consumer_release(read);
    ++read;
    auto ds = tdQrdS(_, _, _, buf);
    dq_chunks<T>(kp, mma_dq, ds, sKt, static_cast<int64_t>(b) * p.num_heads + h, m,
                 dq_turn<T, kIsCausal>(p, m, n_block));
  }
  Tensor cdKV = thr_dkv.partition_C(make_identity_tensor(typename T::TileDKV{}));
  store_dkdv_swapped<T, RawElement>(p, tdKrdK, tdVrdV, cdKV, n0, kv, b, group);
}

}  // namespace bwd
}  // namespace attn_export::cuda::sm90
