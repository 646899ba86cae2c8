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
// window the key blocks visiting a query block are a range, not a prefix (dq_turn below).
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

#include "../key_tile_range.cuh"
#include "../launch.h"
#include "flash_bwd_sm90.h"
#include "flash_bwd_sm90_traits.cuh"
#include "flash_fwd_sm90_kernel.cuh"  // CutlassElement, make_tma, probabilities_as_operand, warpgroup_gemm

namespace attn_export::cuda::sm90 {
namespace bwd {

inline constexpr float kLog2e = 1.4426950408889634f;
// Named barriers of the MMA warpgroups (ids counted after CUTLASS's reserved ones).
inline constexpr uint32_t kBarrierDs = 0;     // dS of a query block is in shared memory
inline constexpr uint32_t kBarrierOrder = 1;  // deterministic mode: this key block's turn
inline constexpr uint32_t kBarrierDsFree = 2;  // one dS/P buffer (d256): the last block's readers are done

// The first query block that sees any of the keys from n0 on: under causality, query i sees
// keys j <= i + shift. Non-decreasing in n0.
template <typename T, bool kIsCausal>
__device__ __forceinline__ int first_query_block(const AttentionParams& p, int n0) {
  if constexpr (!kIsCausal) {
    return 0;
  }
  const int64_t first = n0 - p.causal_shift();
  return first <= 0 ? 0 : static_cast<int>((first < p.seqlen_q ? first : p.seqlen_q) / T::kBlockM);
}

// The end of the query blocks that see any of the keys [n0, n0 + kBlockN): with a sliding
// window, query i sees key j only while i < j - shift + window, so no query from the block's
// last key's (last - shift + window) on; without one, every query block. Non-decreasing in n0.
// Producer, consumers and skip_padded_key_block walk [first_query_block, end_query_block).
template <typename T, bool kIsCausal>
__device__ __forceinline__ int end_query_block(const AttentionParams& p, int n0) {
  const int64_t seqlen_q = p.seqlen_q;
  int64_t end = seqlen_q;
  if (kIsCausal && p.window > 0) {
    const int64_t last_key = (n0 + T::kBlockN < p.seqlen_k ? n0 + T::kBlockN : p.seqlen_k) - 1;
    const int64_t window_end = last_key - p.causal_shift() + p.window;
    end = window_end <= 0 ? 0 : (window_end < seqlen_q ? window_end : seqlen_q);
  }
  return static_cast<int>((end + T::kBlockM - 1) / T::kBlockM);
}

// Deterministic mode: the turn of key block n at query block m. Key block n visits m iff
// first_query_block(n) <= m < end_query_block(n). Both bounds are non-decreasing in n, so the key
// blocks visiting m are one contiguous range [first(m), last(m)]: last(m) from the first bound
// (without a window, first(m) = 0: a prefix), first(m) from the second, and
//   m < end_query_block(n)  <=>  (n's last key) - shift + window > m kBlockM
//                           <=>  (n + 1) kBlockN > m kBlockM + 1 + shift - window
//                           <=>  n >= causal_key_begin(m kBlockM) / kBlockN
// (the block holding the first key of query block m's first query's window; when that key is
// past the last, no block visits m and the clamp does not matter). So the turns of m run
// 0, 1, ... over first(m), first(m) + 1, ..., last(m): key block n waits for turn n - first(m)
// and passes on n - first(m) + 1, each waiting only for its predecessor n - 1, which visits m
// too (first(m) <= n - 1 <= last(m)): the same order on every run, and no wait on a block that
// never comes (all of them count from the zeroed workspace, as without a window).
template <typename T, bool kIsCausal>
__device__ __forceinline__ int dq_turn(const AttentionParams& p, int m, int n_block) {
  if constexpr (!kIsCausal) {
    return n_block;
  }
  return n_block - static_cast<int>(p.causal_key_begin(static_cast<int64_t>(m) * T::kBlockM) / T::kBlockN);
}

// Query heads per key/value head.
__device__ __forceinline__ int group_size(const AttentionParams& p) {
  return static_cast<int>(p.num_heads / (p.num_heads_k > 0 ? p.num_heads_k : p.num_heads));
}

__device__ __forceinline__ int load_acquire(const int* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(int* ptr, int value) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// ---- 1. delta and lse2, one warp per (padded) query row.

template <typename Element>
__global__ void flash_bwd_sm90_prepare(const AttentionBackwardParams p, float* __restrict__ lse2,
                                       float* __restrict__ delta, int64_t rounded) {
  constexpr int kWarps = 8;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.batch * p.num_heads * rounded) {
    return;
  }
  const int64_t bh = row / rounded, i = row % rounded, b = bh / p.num_heads, h = bh % p.num_heads;
  float dot = 0.f, l = device::neg_inf<float>();
  if (i < p.seqlen_q) {
    const Element* o = static_cast<const Element*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride +
        i * p.out_row_stride;
    const Element* d = static_cast<const Element*>(p.grad_out) + b * p.grad_out_batch_stride +
        h * p.grad_out_head_stride + i * p.grad_out_row_stride;
    for (int c = lane; c < p.head_dim_v; c += 32) {
      dot += device::to_acc(o[c]) * device::to_acc(d[c]);
    }
    l = static_cast<const float*>(p.lse)[bh * p.seqlen_q + i];
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  }
  if (lane == 0) {
    delta[row] = dot;
    lse2[row] = l == device::neg_inf<float>() ? INFINITY : l * kLog2e;
  }
}

// ---- 3. grad_q = scale * dq_accum, two columns per thread (grid-stride).

template <typename Element>
__global__ void flash_bwd_sm90_convert_dq(const AttentionBackwardParams p, const float* __restrict__ dq_accum,
                                          int64_t rounded) {
  const int64_t pairs = p.head_dim / 2, total = p.batch * p.num_heads * p.seqlen_q * pairs;
  const float scale = static_cast<float>(p.scale);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = idx % pairs * 2, row = idx / pairs % p.seqlen_q, bh = idx / (pairs * p.seqlen_q);
    const float* src = dq_accum + (bh * rounded + row) * p.head_dim + c;
    Element* dst = static_cast<Element*>(p.grad_q) + bh / p.num_heads * p.grad_q_batch_stride +
        bh % p.num_heads * p.grad_q_head_stride + row * p.grad_q_row_stride + c;
    *reinterpret_cast<uint32_t*>(dst) = device::pack2<Element>(src[0] * scale, src[1] * scale);
  }
}

// ---- 2. The main kernel's producer: one thread of warpgroup 0 issues every load.

template <typename T, bool kIsCausal>
__device__ void produce(const BwdKernelParams<T>& kp, typename T::SharedStorage& shared, typename T::Pipeline& pipe,
                        int n_block, int kv, int b) {
  const AttentionBackwardParams& p = kp.attn;
  const int heads_k = static_cast<int>(p.num_heads_k > 0 ? p.num_heads_k : p.num_heads);
  const int group = group_size(p);
  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename T::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename T::SmemLayoutV{});
  const auto q_shape = make_shape(int(p.seqlen_q), int(p.head_dim), int(p.num_heads), int(p.batch));
  Tensor mQ = kp.tma_q.get_tma_tensor(q_shape);
  Tensor mdO = kp.tma_do.get_tma_tensor(q_shape);
  Tensor mK = kp.tma_k.get_tma_tensor(make_shape(int(p.seqlen_k), int(p.head_dim), heads_k, int(p.batch)));
  Tensor mV = kp.tma_v.get_tma_tensor(make_shape(int(p.seqlen_k), int(p.head_dim_v), heads_k, int(p.batch)));
  Tensor gK = local_tile(mK(_, _, kv, b), typename T::TileKD{}, make_coord(n_block, _0{}));
  Tensor gV = local_tile(mV(_, _, kv, b), typename T::TileKD{}, make_coord(n_block, _0{}));
  auto [tKg, tKs] = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVg, tVs] = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
  shared.barrier_kv.arrive_and_expect_tx(T::kTmaBytesKV);
  copy(kp.tma_k.with(reinterpret_cast<uint64_t&>(shared.barrier_kv), 0), tKg, tKs);
  copy(kp.tma_v.with(reinterpret_cast<uint64_t&>(shared.barrier_kv), 0), tVg, tVs);

  // One flat loop over (query head of the group, query block), everything recomputed per step:
  // the producer has 24 registers (32-bit block counts and the head as the loop variable: at d256
  // one more live value spilled).
  const int m_begin = first_query_block<T, kIsCausal>(p, n_block * T::kBlockN);
  const int m_end = end_query_block<T, kIsCausal>(p, n_block * T::kBlockN);
  using TileQ = typename T::TileQD;
  auto write = cutlass::make_producer_start_state<typename T::Pipeline>();
  int m = m_begin;
#pragma unroll 1  // unrolled, the loop would not fit the producer's registers
  for (int h = kv * group; h < (kv + 1) * group && m_begin < m_end;) {
    Tensor gQ = local_tile(mQ(_, _, h, b), TileQ{}, make_coord(m, _0{}));
    Tensor gdO = local_tile(mdO(_, _, h, b), TileQ{}, make_coord(m, _0{}));
    auto [tQg, tQs] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOg, tdOs] = tma_partition(kp.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    const int64_t row = (static_cast<int64_t>(b) * p.num_heads + h) * kp.seqlen_q_rounded + m * T::kBlockM;
    pipe.producer_acquire(write);  // waits for the slot to be free, then expects its bytes
    uint64_t* full = pipe.producer_get_barrier(write);
    const int s = write.index();
    copy(kp.tma_q.with(*full, 0), tQg, tQs(_, s));
    copy(kp.tma_do.with(*full, 0), tdOg, tdOs(_, s));
    SM90_BULK_COPY_G2S::copy(kp.lse2 + row, full, shared.lse2[s], T::kTmaBytesRows);
    SM90_BULK_COPY_G2S::copy(kp.delta + row, full, shared.delta[s], T::kTmaBytesRows);
    ++write;
    if (++m == m_end) {
      m = m_begin;
      ++h;
    }
  }
  pipe.producer_tail(write);  // do not exit while the consumers still read
}

// ---- The consumers' steps.

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
      (kIsCausal && n0 + T::kBlockN - 1 > m0 + shift) || (kIsCausal && mask.window_reaches(m0 + T::kBlockM - 1, n0));
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

// Deterministic mode: wait until this key block's turn (dq_turn: `rank`) to add to query block
// m's dQ; returns the turn's int (nullptr in the atomic mode, where nothing waits).
template <typename T>
__device__ __forceinline__ int* dq_turn_wait(const BwdKernelParams<T>& kp, int64_t bh, int m, int rank) {
  int* turn = kp.order == nullptr ? nullptr : kp.order + bh * (kp.seqlen_q_rounded / T::kBlockM) + m;
  if (turn != nullptr) {
    if (threadIdx.x == 128) {
      while (load_acquire(turn) != rank) {
      }
    }
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierOrder);
  }
  return turn;
}

// ... and pass the turn to the next key block once every consumer thread has added.
template <typename T>
__device__ __forceinline__ void dq_turn_pass(int* turn, int rank) {
  if (turn != nullptr) {
    __threadfence();
    cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBarrierOrder);
    if (threadIdx.x == 128) {
      store_release(turn, rank + 1);
    }
  }
}

// Adds dQ values (unscaled; coord: (query row in the block, column)) into the fp32 workspace:
// atomics, or in deterministic mode (this key block's turn) plain read-modify-writes.
template <typename T, typename TQ, typename TC>
__device__ __forceinline__ void add_dq_values(float* base, const TQ& dq, const TC& coord, bool ordered) {
  Tensor dq_rc = make_tensor(dq.data(), rowcol(dq.layout()));
  Tensor c_rc = make_tensor(coord.data(), rowcol(coord.layout()));
  CUTE_UNROLL
  for (int r = 0; r < size<0>(dq_rc); ++r) {
    float* row = base + get<0>(c_rc(r, 0)) * T::kHeadDim;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(dq_rc); c += 2) {
      float2* dst = reinterpret_cast<float2*>(row + get<1>(c_rc(r, c)));
      const float2 add = make_float2(dq_rc(r, c), dq_rc(r, c + 1));
      if (!ordered) {
        atomicAdd(dst, add);
      } else {
        const float2 old = __ldcg(dst);
        __stcg(dst, make_float2(old.x + add.x, old.y + add.y));
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ float* dq_block(const BwdKernelParams<T>& kp, int64_t bh, int m) {
  return kp.dq_accum + (bh * kp.seqlen_q_rounded + m * T::kBlockM) * T::kHeadDim;
}

// Adds one query block's dQ (unscaled) into the fp32 workspace; rank: dq_turn.
template <typename T, typename TQ, typename TC>
__device__ __forceinline__ void add_dq(const BwdKernelParams<T>& kp, const TQ& dq, const TC& coord, int64_t bh, int m,
                                       int rank) {
  int* turn = dq_turn_wait(kp, bh, m, rank);
  add_dq_values<T>(dq_block(kp, bh, m), dq, coord, turn != nullptr);
  dq_turn_pass<T>(turn, rank);
}

// dK = scale * sum dS^T Q and dV = sum P^T dO at the group's first query head, zeros at the
// others (the binding sums grad_k/grad_v over each group). Two columns per 4-byte store.
template <typename T, typename RawElement, typename TA, typename TC>
__device__ __forceinline__ void store_dkdv(const AttentionBackwardParams& p, const TA& dk, const TA& dv,
                                           const TC& coord, int n0, int kv, int b, int group) {
  Tensor dk_rc = make_tensor(dk.data(), rowcol(dk.layout()));
  Tensor dv_rc = make_tensor(dv.data(), rowcol(dv.layout()));
  Tensor c_rc = make_tensor(coord.data(), rowcol(coord.layout()));
  const float scale = static_cast<float>(p.scale);
  CUTE_UNROLL
  for (int r = 0; r < size<0>(dk_rc); ++r) {
    const int key = n0 + get<0>(c_rc(r, 0));
    if (key >= p.seqlen_k) {
      continue;
    }
    for (int g = 0; g < group; ++g) {
      const int64_t h = static_cast<int64_t>(kv) * group + g;
      const bool first = g == 0;  // zeros, not 0 * dK: exact even where dK overflowed
      RawElement* k_row = static_cast<RawElement*>(p.grad_k) + b * p.grad_k_batch_stride + h * p.grad_k_head_stride +
          key * p.grad_k_row_stride;
      RawElement* v_row = static_cast<RawElement*>(p.grad_v) + b * p.grad_v_batch_stride + h * p.grad_v_head_stride +
          key * p.grad_v_row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(dk_rc); c += 2) {
        const int col = get<1>(c_rc(r, c));
        *reinterpret_cast<uint32_t*>(k_row + col) =
            device::pack2<RawElement>(first ? dk_rc(r, c) * scale : 0.f, first ? dk_rc(r, c + 1) * scale : 0.f);
        *reinterpret_cast<uint32_t*>(v_row + col) =
            device::pack2<RawElement>(first ? dv_rc(r, c) : 0.f, first ? dv_rc(r, c + 1) : 0.f);
      }
    }
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
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  const auto smem = [](auto& storage, auto layout) { return make_tensor(make_smem_ptr(storage.data()), layout); };
  Tensor tSrK = thr_sdp.partition_fragment_A(smem(shared.k, typename T::SmemLayoutK{}));
  Tensor tSrQ = thr_sdp.partition_fragment_B(smem(shared.q, typename T::SmemLayoutQ{}));
  Tensor tdPrV = thr_sdp.partition_fragment_A(smem(shared.v, typename T::SmemLayoutV{}));
  Tensor tdPrdO = thr_sdp.partition_fragment_B(smem(shared.dout, typename T::SmemLayoutdO{}));
  Tensor tdVrdO = thr_dkv.partition_fragment_B(smem(shared.dout, typename T::SmemLayoutQt{}));
  Tensor tdKrQ = thr_dkv.partition_fragment_B(smem(shared.q, typename T::SmemLayoutQt{}));
  Tensor tdQrdS = thr_dq.partition_fragment_A(smem(shared.ds, typename T::SmemLayoutdS{}));
  Tensor tdQrK = thr_dq.partition_fragment_B(smem(shared.k, typename T::SmemLayoutKt{}));
  Tensor sdSt = smem(shared.ds, typename T::SmemLayoutdSt{});
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(typename T::TileKQ{}));
  Tensor cdQ = thr_dq.partition_C(make_identity_tensor(typename T::TileQD{}));
  Tensor tdVrdV = partition_fragment_C(mma_dkv, typename T::TileKD{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, typename T::TileKD{});
  clear(tdVrdV);
  clear(tdKrdK);
  const int n0 = n_block * T::kBlockN;
  const int m_begin = first_query_block<T, kIsCausal>(p, n0);
  const int m_blocks = end_query_block<T, kIsCausal>(p, n0);

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

// dK^T, dV^T (head dim x keys, `coord`: (dim, key)) -> grad_k, grad_v as store_dkdv does, one
// element per store: a thread's adjacent accumulators are adjacent keys, not adjacent columns.
template <typename T, typename RawElement, typename TA, typename TC>
__device__ __forceinline__ void store_dkdv_swapped(const AttentionBackwardParams& p, const TA& dk, const TA& dv,
                                                   const TC& coord, int n0, int kv, int b, int group) {
  const float scale = static_cast<float>(p.scale);
#pragma unroll 1
  for (int g = 0; g < group; ++g) {
    const int64_t h = static_cast<int64_t>(kv) * group + g;
    const bool first = g == 0;  // zeros, not 0 * dK: exact even where dK overflowed
    RawElement* k_head = static_cast<RawElement*>(p.grad_k) + b * p.grad_k_batch_stride + h * p.grad_k_head_stride;
    RawElement* v_head = static_cast<RawElement*>(p.grad_v) + b * p.grad_v_batch_stride + h * p.grad_v_head_stride;
    CUTE_UNROLL
    for (int i = 0; i < size(dk); ++i) {
      const int dim = get<0>(coord(i)), key = n0 + get<1>(coord(i));
      if (key < p.seqlen_k) {
        k_head[key * p.grad_k_row_stride + dim] = device::from_acc<RawElement>(first ? dk(i) * scale : 0.f);
        v_head[key * p.grad_v_row_stride + dim] = device::from_acc<RawElement>(first ? dv(i) : 0.f);
      }
    }
  }
}

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
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  const auto smem = [](auto& storage, auto layout) { return make_tensor(make_smem_ptr(storage.data()), layout); };
  Tensor tSrK = thr_sdp.partition_fragment_A(smem(shared.k, typename T::SmemLayoutK{}));
  Tensor tSrQ = thr_sdp.partition_fragment_B(smem(shared.q, typename T::SmemLayoutQ{}));
  Tensor tdPrV = thr_sdp.partition_fragment_A(smem(shared.v, typename T::SmemLayoutV{}));
  Tensor tdPrdO = thr_sdp.partition_fragment_B(smem(shared.dout, typename T::SmemLayoutdO{}));
  Tensor tdVrdOt = thr_dkv.partition_fragment_A(smem(shared.dout, typename T::SmemLayoutQt{}));
  Tensor tdKrQt = thr_dkv.partition_fragment_A(smem(shared.q, typename T::SmemLayoutQt{}));
  Tensor tdVrP = thr_dkv.partition_fragment_B(smem(shared.p, typename T::SmemLayoutdSt{}));
  Tensor tdKrdS = thr_dkv.partition_fragment_B(smem(shared.ds, typename T::SmemLayoutdSt{}));
  Tensor tdQrdS = thr_dq.partition_fragment_A(smem(shared.ds, typename T::SmemLayoutdS{}));
  Tensor sKt = smem(shared.k, typename T::SmemLayoutKt{});
  Tensor sPt = smem(shared.p, typename T::SmemLayoutdSt{});
  Tensor sdSt = smem(shared.ds, typename T::SmemLayoutdSt{});
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(typename T::TileKQ{}));
  Tensor tdVrdV = partition_fragment_C(mma_dkv, typename T::TileDKV{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, typename T::TileDKV{});
  clear(tdVrdV);
  clear(tdKrdK);
  const int n0 = n_block * T::kBlockN, group = group_size(p);
  const int m_begin = first_query_block<T, kIsCausal>(p, n0);
  const int m_blocks = end_query_block<T, kIsCausal>(p, n0);
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

// Padded batches (params.skip_padded_key_tiles; key_tile_range.cuh, the sm80 backward's `own`
// check): when the key-padding mask pads every key of this block, dK = dV = 0 for the group's
// query heads and no query block is loaded; in deterministic mode the block still passes on its
// turn (dq_turn) at each query block it would have added to, after its predecessor's. Every thread calls
// it before any barrier or copy (`scratch`: two ints of shared memory, free then); true: done.
template <typename T, typename RawElement, bool kIsCausal>
__device__ bool skip_padded_key_block(const BwdKernelParams<T>& kp, int n_block, int kv, int b, int* scratch) {
  const AttentionBackwardParams& p = kp.attn;
  const device::KeyTiles own = device::key_tile_range<T::kBlockN, T::kThreads>(p, b, n_block, n_block + 1, scratch);
  if (own.begin < own.end) {
    return false;
  }
  const int group = group_size(p), n0 = n_block * T::kBlockN;
  const int keys = device::imin(T::kBlockN, static_cast<int>(p.seqlen_k) - n0);
  const int pairs = static_cast<int>((p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v) / 2);
  for (int i = threadIdx.x; i < group * keys * pairs; i += T::kThreads) {  // 4-byte stores, as store_dkdv
    const int col = 2 * (i % pairs), key = n0 + i / pairs % keys;
    const int64_t h = static_cast<int64_t>(kv) * group + i / pairs / keys;
    if (col < p.head_dim) {
      *reinterpret_cast<uint32_t*>(static_cast<RawElement*>(p.grad_k) + b * p.grad_k_batch_stride +
                                   h * p.grad_k_head_stride + key * p.grad_k_row_stride + col) = 0u;
    }
    if (col < p.head_dim_v) {
      *reinterpret_cast<uint32_t*>(static_cast<RawElement*>(p.grad_v) + b * p.grad_v_batch_stride +
                                   h * p.grad_v_head_stride + key * p.grad_v_row_stride + col) = 0u;
    }
  }
  if (kp.order != nullptr && threadIdx.x == 0) {
    const int m_blocks = static_cast<int>(kp.seqlen_q_rounded / T::kBlockM);
    for (int g = 0; g < group; ++g) {
      int* turns = kp.order + (static_cast<int64_t>(b) * p.num_heads + kv * group + g) * m_blocks;
      for (int m = first_query_block<T, kIsCausal>(p, n0); m < end_query_block<T, kIsCausal>(p, n0); ++m) {
        const int rank = dq_turn<T, kIsCausal>(p, m, n_block);
        while (load_acquire(turns + m) != rank) {
        }
        store_release(turns + m, rank + 1);
      }
    }
  }
  return true;
}

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
