// Where the Hopper backward's results go (flash_bwd_sm90_kernel.cuh): dQ added into the fp32
// workspace (atomics, or in deterministic mode one key block after the other, dq_turn), dK and dV
// stored per query head (the group's sum at its first head, zeros at the others), and the whole
// epilogue of a key block that the key-padding mask pads entirely.
#pragma once

#include "../block_bounds.h"
#include "../key_tile_range.cuh"
#include "flash_bwd_sm90_traits.cuh"
#include "flash_fwd_sm90_softmax.cuh"  // rowcol

namespace attn_export::cuda::sm90 {
namespace bwd {

// Deterministic mode: the turn of key block n at query block m. Key block n visits m iff
// m is in bounds::query_blocks(n) = [first(n), end(n)) (block_bounds.h; producer, consumers and
// skip_padded_key_block walk that range). Both bounds are non-decreasing in n, so the key
// blocks visiting m are one contiguous range [first(m), last(m)]: last(m) from the first bound
// (without a window, first(m) = 0: a prefix), first(m) from the second, and
//   m < end(n)              <=>  (n's last key) - shift + window > m kBlockM
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

__device__ __forceinline__ int load_acquire(const int* ptr) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void store_release(int* ptr, int value) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
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

// Padded batches (params.skip_padded_key_tiles; key_tile_range.cuh, the sm80 backward's `own`
// check): when the key-padding mask pads every key of this block, dK = dV = 0 for the group's
// query heads and no query block is loaded; in deterministic mode the block still passes on its
// turn (dq_turn) at each query block it would have added to, after its predecessor's. Every thread calls
// it before any barrier or copy (`scratch`: two ints of shared memory, free then); true: done.
template <typename T, typename RawElement, bool kIsCausal>
__device__ bool skip_padded_key_block(const BwdKernelParams<T>& kp, int n_block, int kv, int b, int* scratch) {
  const AttentionBackwardParams& p = kp.attn;
  const bounds::TileRange own = device::key_tile_range<T::kBlockN, T::kThreads>(p, b, n_block, n_block + 1, scratch);
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
      const bounds::TileRange seen_by = bounds::query_blocks<T::kBlockM, T::kBlockN, kIsCausal>(p, n0);
      for (int m = seen_by.begin; m < seen_by.end; ++m) {
        const int rank = dq_turn<T, kIsCausal>(p, m, n_block);
        while (load_acquire(turns + m) != rank) {
        }
        store_release(turns + m, rank + 1);
      }
    }
  }
  return true;
}

}  // namespace bwd
}  // namespace attn_export::cuda::sm90
