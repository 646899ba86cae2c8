// The Hopper forward: softmax(cap(scale * Q K^T) + masks) V and the row log-sum-exp, for one
// (batch, head, block of 128 query rows) per thread block, on sm_90a's own instructions.
//
// Warp specialization (FlashAttention-3, CUTLASS's Hopper FMHA): warpgroup 0 produces, one
// thread issuing TMA bulk tensor loads of Q (once) and of each K and V tile into a kStages-deep
// ring of shared-memory buffers (cutlass::PipelineTmaAsync: a full barrier that the TMA
// completes by transaction bytes, an empty barrier the consumers release); warpgroups 1 and 2
// consume, 64 query rows each: S = Q K^T with wgmma from shared memory (SS), the scale,
// soft-cap and masks in registers, the online softmax in fp32, and O += P V with wgmma taking P
// from registers (RS). setmaxnreg moves registers from the producer to the consumers.
//
// Semantics are those of the sm80 kernel (flash_fwd_kernel.cuh) through the same ScoreMask:
// boolean/additive attn_mask and key_padding_mask with broadcast strides, both causal
// alignments, the sliding window, grouped-query heads (TMA reads key/value head kv_head(h)),
// fully masked rows -> 0 and lse = -inf. Rows and keys past the sequence ends are zero-filled
// by the TMA unit (out-of-bounds boxes) and masked. With params.skip_padded_key_tiles, the key
// tiles a key-padding mask pads entirely at either end are skipped (find_key_tiles).
//
// Scheduling (FlashAttention-3), two compile-time switches of the tile table (fwd_tile()):
// ping-pong, where the two consumer warpgroups take turns issuing their GEMMs (named barriers,
// PingPong below) so that one's softmax runs while the other's GEMMs occupy the tensor cores;
// and intra-warpgroup overlap, where a warpgroup issues tile n+1's Q K^T and tile n's P V and
// runs tile n+1's softmax while they execute (consume_overlapped).
//
// Not yet here (docs/cuda.md "Hopper forward"): a TMA store epilogue, a persistent scheduler.
// And nothing here has run: it is compiled and its SASS checked offline only.
#pragma once

// CuTe keeps the wgmma shapes with N not in {8, 16, 32, 64, 96, 128, 192, 256} (the tile table's
// 80-, 112- and 176-key tiles) behind this switch; it must precede CuTe's first inclusion in the
// unit (FwdTraits asserts that the full-width shapes were selected).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED 1
#endif

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../block_bounds.h"
#include "../key_tile_range.cuh"
#include "../launch.h"
#include "flash_fwd_sm90.h"
#include "flash_fwd_sm90_softmax.cuh"
#include "flash_fwd_sm90_traits.cuh"

// The Hopper instructions exist only in the sm_90a device pass. Every other device pass (sm_80 in
// a mixed arch list, plain sm_90) compiles a body that traps: the dispatch never launches it there,
// and were a plain sm_90 cubin ever picked on a Hopper GPU, an empty body would leave the output
// unwritten and report success. The host pass compiles an empty body.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_EXPORT_SM90_DEVICE_PASS 1
#endif

namespace attn_export::cuda::sm90 {

// CUTLASS's 16-bit types for the CUDA ones the dispatch uses (same bits).
template <typename T>
struct CutlassElement;
template <>
struct CutlassElement<__half> {
  using type = cutlass::half_t;
};
template <>
struct CutlassElement<__nv_bfloat16> {
  using type = cutlass::bfloat16_t;
};

// The key tiles the block visits, into shared `tiles` ([begin, end)): the key tiles any of its rows
// can see (block_bounds.h; producer and consumers walk the same range), clamped with
// params.skip_padded_key_tiles to the tiles holding the first and the last key of the batch row
// that the key-padding mask leaves visible (key_tile_range.cuh, as the sm80 forward; interior
// holes stay masked per element). Every thread calls it, before the role split: the producer and
// both consumer warpgroups then read one pair and walk exactly the same tiles, as their pipeline
// and the ping-pong barriers need, and nothing lives in registers across setmaxnreg. A row with
// no visible key visits no tile: zero output, lse = -inf. `tiles` doubles as the range's scratch.
template <typename Traits, bool kIsCausal>
__device__ __forceinline__ void find_key_tiles(const AttentionParams& p, int m_block, int b, int* tiles) {
  const int m0 = m_block * Traits::kBlockM;
  const bounds::TileRange all = bounds::key_tiles<Traits::kBlockN, kIsCausal>(p, m0, m0 + Traits::kBlockM - 1);
  const bounds::TileRange visible =
      device::key_tile_range<Traits::kBlockN, Traits::kThreads>(p, b, all.begin, all.end, tiles);
  if (threadIdx.x == 0) {  // after key_tile_range's last barrier: every thread has read the scratch
    tiles[0] = visible.begin;
    tiles[1] = visible.end;
  }
}

// ---- The producer: one thread of warpgroup 0 issues every TMA load.

template <typename Traits, bool kIsCausal>
__device__ void produce(const FwdKernelParams<Traits>& kp, typename Traits::SharedStorage& shared,
                        typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v, bounds::TileRange tiles, int m_block,
                        int h, int b) {
  using T = Traits;
  const AttentionParams& p = kp.attn;
  const int heads_k = static_cast<int>(p.num_heads_k > 0 ? p.num_heads_k : p.num_heads);
  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename T::SmemLayoutV{});
  Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(int(p.seqlen_q), int(p.head_dim), int(p.num_heads), int(p.batch)));
  Tensor mK = kp.tma_k.get_tma_tensor(make_shape(int(p.seqlen_k), int(p.head_dim), heads_k, int(p.batch)));
  Tensor mV = kp.tma_v.get_tma_tensor(make_shape(int(p.seqlen_k), int(p.head_dim_v), heads_k, int(p.batch)));
  const int kv = static_cast<int>(p.kv_head(h));  // grouped-query attention: the group's key/value head
  Tensor gQ = local_tile(mQ(_, _, h, b), Shape<typename T::BlockM, typename T::HeadDim>{}, make_coord(m_block, _0{}));
  Tensor gK = local_tile(mK(_, _, kv, b), Shape<typename T::BlockN, typename T::HeadDim>{}, make_coord(_, _0{}));
  Tensor gV = local_tile(mV(_, _, kv, b), Shape<typename T::BlockN, typename T::HeadDim>{}, make_coord(_, _0{}));
  auto [tQg, tQs] = tma_partition(kp.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  auto [tKg, tKs] = tma_partition(kp.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVg, tVs] = tma_partition(kp.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  shared.barrier_q.arrive_and_expect_tx(T::kTmaBytesQ);
  copy(kp.tma_q.with(reinterpret_cast<uint64_t&>(shared.barrier_q), 0), tQg, tQs);
  auto write = cutlass::make_producer_start_state<typename T::Pipeline>();
  for (int n = tiles.begin; n < tiles.end; ++n) {
    pipe_k.producer_acquire(write);  // waits for the slot to be free, then expects its bytes
    copy(kp.tma_k.with(*pipe_k.producer_get_barrier(write), 0), tKg(_, n), tKs(_, write.index()));
    pipe_v.producer_acquire(write);
    copy(kp.tma_v.with(*pipe_v.producer_get_barrier(write), 0), tVg(_, n), tVs(_, write.index()));
    ++write;
  }
  // Do not exit while the consumers still read: wait until every slot was released.
  pipe_k.producer_tail(write);
  pipe_v.producer_tail(write);
}

// ---- The consumers.

// Whether any mask can hide a score of the tile at key n0 of the block at row m0: a mask tensor,
// the keys' end, the causal diagonal or the window's start.
template <typename Traits, bool kIsCausal>
__device__ __forceinline__ bool tile_masked(const AttentionParams& p, const device::ScoreMask<float>& mask, int m0, int n0) {
  constexpr int kBM = Traits::kBlockM, kBN = Traits::kBlockN;
  const int shift = kIsCausal ? static_cast<int>(p.causal_shift()) : 0;
  return mask.reads_memory() || n0 + kBN > p.seqlen_k ||
      (kIsCausal && bounds::causal_edge_in_tile(p, m0, m0 + kBM - 1, n0, kBN, shift));
}

// Scores of one tile into the log2 domain: scaled (and soft-capped), and with kMasked, masked.
// coord: (row, column) within the block of each value of s.
template <bool kMasked, typename TS, typename TC>
__device__ __forceinline__ void scale_and_mask(TS& s, const TC& coord, const AttentionParams& p,
                                               const device::ScoreMask<float>& mask,
                                               const device::SoftCap<float>& softcap, int m0, int n0) {
  constexpr float kLog2e = 1.4426950408889634f;
  const float scale = static_cast<float>(p.scale);
  CUTE_UNROLL
  for (int i = 0; i < size(s); ++i) {
    float x = softcap.on ? softcap.apply(s(i) * scale) * kLog2e : s(i) * (scale * kLog2e);
    if constexpr (kMasked) {
      x = mask.apply(x, m0 + get<0>(coord(i)), n0 + get<1>(coord(i)));
    }
    s(i) = x;
  }
}

// The accumulators (fp32) converted into p, the 16-bit A operand of the P V wgmma (same registers'
// order: acc_as_operand_a).
template <typename TS, typename TP>
__device__ __forceinline__ void convert_probabilities(const TS& s, TP& p) {
  using Element = typename TP::value_type;
  constexpr int kN = decltype(size(s))::value;
  cutlass::NumericArrayConverter<Element, float, kN> convert;
  *reinterpret_cast<cutlass::Array<Element, kN>*>(p.data()) =
      convert(*reinterpret_cast<const cutlass::Array<float, kN>*>(s.data()));
}

// The accumulators (fp32) as a new 16-bit A operand of a register-sourced wgmma (the backward,
// flash_bwd_sm90_kernel.cuh, converts its P and dS with it).
template <typename Element, typename TS>
__device__ __forceinline__ auto probabilities_as_operand(const TS& s) {
  Tensor p = make_tensor<Element>(acc_as_operand_a(s.layout()));
  convert_probabilities(s, p);
  return p;
}

// Ping-pong: the two consumer warpgroups take turns at issuing GEMMs. Warpgroup w waits on named
// barrier kFirst + w before its turn and, once its GEMMs are issued, arrives on the other's. The
// first warpgroup's first turn needs no wait and the second's last arrival nobody would wait for:
// both are left out, so the barriers balance for any number of turns (none included) and none is
// pending when the block exits. Both warpgroups walk the same key tiles, so take as many turns.
template <bool kOn>
struct PingPong {
  static constexpr uint32_t kFirst = 0;  // user barrier ids (after CUTLASS's reserved ones)
  static constexpr uint32_t kThreads = 2 * 128;
  int wg;  // 0 or 1: which consumer warpgroup

  // (Constant barrier ids in each branch: no register holds them.)
  __device__ __forceinline__ void begin_turn(bool first) const {
    if constexpr (kOn) {
      if (wg == 1) {
        cutlass::arch::NamedBarrier::sync(kThreads, kFirst + 1);
      } else if (!first) {
        cutlass::arch::NamedBarrier::sync(kThreads, kFirst);
      }
    }
  }
  __device__ __forceinline__ void end_turn(bool last) const {
    if constexpr (kOn) {
      if (wg == 0) {
        cutlass::arch::NamedBarrier::arrive(kThreads, kFirst + 1);
      } else if (!last) {
        cutlass::arch::NamedBarrier::arrive(kThreads, kFirst);
      }
    }
  }
};

// Normalizes O and writes it with the log-sum-exp (natural log). A row with no visible key has
// sum 0: zero output and lse = -inf. Two adjacent columns per 4-byte store.
template <typename Traits, typename RawElement, typename Softmax, typename TO, typename TC>
__device__ __forceinline__ void store_output(const AttentionParams& p, const TO& o, const TC& coord, Softmax& softmax,
                                             int m0, int h, int b) {
  constexpr float kLn2 = 0.6931471805599453f;
  Tensor o_rc = make_tensor(o.data(), rowcol(o.layout()));
  Tensor c_rc = make_tensor(coord.data(), rowcol(coord.layout()));
  RawElement* out = static_cast<RawElement*>(p.out) + b * p.out_batch_stride + h * p.out_head_stride;
  float* lse = static_cast<float*>(p.lse) + (b * p.num_heads + h) * p.seqlen_q;
  CUTE_UNROLL
  for (int r = 0; r < size<0>(o_rc); ++r) {
    float sum = softmax.row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const bool visible = sum > 0.f;
    const float inv = visible ? 1.f / sum : 0.f;
    const int row = m0 + get<0>(c_rc(r, 0));
    if (row < p.seqlen_q) {
      RawElement* dst = out + row * p.out_row_stride;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); c += 2) {
        *reinterpret_cast<uint32_t*>(dst + get<1>(c_rc(r, c))) =
            device::pack2<RawElement>(o_rc(r, c) * inv, o_rc(r, c + 1) * inv);
      }
      if (threadIdx.x % 4 == 0) {
        lse[row] = visible ? softmax.row_max[r] * kLn2 + logf(sum) : device::neg_inf<float>();
      }
    }
  }
}

// A consumer warpgroup's GEMMs and their operands: Q and the K/V ring in shared memory (wgmma
// descriptors), O and P in registers. wg: 0 or 1, which consumer warpgroup.
template <typename T>
struct ConsumerMma {
  int tid;  // within the consumers
  typename T::TiledMmaQK qk;
  typename T::TiledMmaPV pv;
  decltype(qk.get_thread_slice(0)) thr_qk = qk.get_thread_slice(tid);
  decltype(pv.get_thread_slice(0)) thr_pv = pv.get_thread_slice(tid);
};

// The serial schedule: per tile, S = Q K^T, its softmax, then O += P V, each GEMM waited for.
// With ping-pong, a turn is Q K^T of tile n+1 issued after P V of tile n (one wait between).
template <typename T, typename PP, typename TQ, typename TK, typename TV, typename TO, typename Scores>
__device__ __forceinline__ void mainloop_serial(ConsumerMma<T>& m, const TQ& tSrQ, const TK& tSrK, const TV& tOrV,
    TO& tOrO, typename T::Pipeline& pipe_k, typename T::Pipeline& pipe_v, bounds::TileRange tiles, PP pp, Scores&& scores) {
  typename T::PipelineState read;
  for (int n = tiles.begin; n < tiles.end; ++n) {
    Tensor tSrS = partition_fragment_C(m.qk, Shape<typename T::BlockM, typename T::BlockN>{});
    pipe_k.consumer_wait(read);
    if (n == tiles.begin) {
      pp.begin_turn(true);
    }
    warpgroup_gemm<true, false>(m.qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
    pp.end_turn(false);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipe_k.consumer_release(read);
    float correction[decltype(size<0>(rowcol(tOrO.layout())))::value];
    scores(tSrS, n, correction, [] {});
    Tensor o_rc = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
    rescale_rows(o_rc, correction);
    Tensor tOrP = make_tensor<typename T::Element>(acc_as_operand_a(tSrS.layout()));
    convert_probabilities(tSrS, tOrP);
    pipe_v.consumer_wait(read);
    pp.begin_turn(false);
    warpgroup_gemm<false>(m.pv, tOrP, tOrV(_, _, _, read.index()), tOrO);
    pipe_v.consumer_release(read);
    ++read;
  }
  if (tiles.begin < tiles.end) {
    pp.end_turn(true);
  }
}

// The overlapped schedule (FlashAttention-3's intra-warpgroup pipelining): after the first tile,
// each step issues Q K^T of tile n and P V of tile n-1 together (one ping-pong turn), then runs
// tile n's softmax while P V executes; O's rescale waits for P V. The last P V follows the loop.
template <typename T, typename PP, typename TQ, typename TK, typename TV, typename TO, typename Scores>
__device__ __forceinline__ void mainloop_overlapped(ConsumerMma<T>& m, const TQ& tSrQ, const TK& tSrK, const TV& tOrV,
    TO& tOrO, typename T::Pipeline& pipe_k, typename T::Pipeline& pipe_v, bounds::TileRange tiles, PP pp, Scores&& scores) {
  if (tiles.begin == tiles.end) {
    return;
  }
  typename T::PipelineState read;
  Tensor tSrS = partition_fragment_C(m.qk, Shape<typename T::BlockM, typename T::BlockN>{});
  Tensor tOrP = make_tensor<typename T::Element>(acc_as_operand_a(tSrS.layout()));
  Tensor o_rc = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  float correction[decltype(size<0>(o_rc))::value];
  pipe_k.consumer_wait(read);
  warpgroup_gemm<true>(m.qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
  pipe_k.consumer_release(read);
  scores(tSrS, tiles.begin, correction, [] {});  // O is still zero: no rescale
  convert_probabilities(tSrS, tOrP);
  for (int n = tiles.begin + 1; n < tiles.end; ++n) {
    const typename T::PipelineState read_v = read;  // P V of tile n-1
    ++read;
    pipe_k.consumer_wait(read);
    pp.begin_turn(n == tiles.begin + 1);
    warpgroup_gemm<true, false>(m.qk, tSrQ, tSrK(_, _, _, read.index()), tSrS);
    pipe_v.consumer_wait(read_v);
    warpgroup_gemm<false, false>(m.pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    pp.end_turn(n + 1 == tiles.end);
    warpgroup_wait<1>();  // Q K^T done, P V may still run
    warpgroup_fence_operand(tSrS);
    pipe_k.consumer_release(read);
    auto drain = [&] {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
    };
    scores(tSrS, n, correction, drain);
    drain();  // a no-op where scores() drained
    pipe_v.consumer_release(read_v);
    rescale_rows(o_rc, correction);
    convert_probabilities(tSrS, tOrP);
  }
  pipe_v.consumer_wait(read);
  warpgroup_gemm<false>(m.pv, tOrP, tOrV(_, _, _, read.index()), tOrO);
  pipe_v.consumer_release(read);
}

template <typename Traits, typename RawElement>
__device__ __forceinline__ void consume(const AttentionParams& p, typename Traits::SharedStorage& shared,
    typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v, bounds::TileRange tiles, int m_block, int h, int b) {
  using T = Traits;
  constexpr float kLog2e = 1.4426950408889634f;
  ConsumerMma<T> m{static_cast<int>(threadIdx.x) - 128};
  Tensor tSrQ = m.thr_qk.partition_fragment_A(make_tensor(make_smem_ptr(shared.q.data()), typename T::SmemLayoutQ{}));
  Tensor tSrK = m.thr_qk.partition_fragment_B(make_tensor(make_smem_ptr(shared.k.data()), typename T::SmemLayoutK{}));
  Tensor tOrV = m.thr_pv.partition_fragment_B(make_tensor(make_smem_ptr(shared.v.data()), typename T::SmemLayoutVt{}));
  Tensor tOrO = partition_fragment_C(m.pv, Shape<typename T::BlockM, typename T::HeadDim>{});
  clear(tOrO);
  Tensor cS = m.thr_qk.partition_C(make_identity_tensor(Shape<typename T::BlockM, typename T::BlockN>{}));
  Tensor cO = m.thr_pv.partition_C(make_identity_tensor(Shape<typename T::BlockM, typename T::HeadDim>{}));
  OnlineSoftmax<decltype(size<0>(rowcol(tOrO.layout())))::value> softmax;
  const device::ScoreMask<float> mask(p, b, h, kLog2e);
  const device::SoftCap<float> softcap(p);
  const int m0 = m_block * T::kBlockM;
  // A tile's scores -> its probabilities, and the correction O needs. The per-element mask code
  // needs registers that the overlapped schedule's in-flight P holds: drain() first waits for
  // that P V (a tile that needs a mask gives up its overlap), so the registers are free.
  auto scores = [&](auto& tSrS, int n, auto& correction, auto&& drain) {
    const int n0 = n * T::kBlockN;
    if (tile_masked<T, T::kIsCausal>(p, mask, m0, n0)) {
      drain();
      scale_and_mask<true>(tSrS, cS, p, mask, softcap, m0, n0);
    } else {
      scale_and_mask<false>(tSrS, cS, p, mask, softcap, m0, n0);
    }
    Tensor s_rc = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
    softmax.update(s_rc, correction);
  };
  const PingPong<T::kPingPong> pp{m.tid / 128};

  shared.barrier_q.wait(0);
  if constexpr (T::kOverlap) {
    mainloop_overlapped(m, tSrQ, tSrK, tOrV, tOrO, pipe_k, pipe_v, tiles, pp, scores);
  } else {
    mainloop_serial(m, tSrQ, tSrK, tOrV, tOrO, pipe_k, pipe_v, tiles, pp, scores);
  }
  store_output<T, RawElement>(p, tOrO, cO, softmax, m0, h, b);
}

template <typename Traits, typename RawElement, bool kIsCausal>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdKernelParams<Traits> kp) {
#if defined(ATTN_EXPORT_SM90_DEVICE_PASS)
  using T = Traits;
  using Pipeline = typename T::Pipeline;
  extern __shared__ __align__(1024) unsigned char attn_export_sm90_smem[];
  auto& shared = *reinterpret_cast<typename T::SharedStorage*>(attn_export_sm90_smem);
  const int warpgroup = threadIdx.x / 128;
  // Causal: the last query blocks see the most keys; launched first, they do not form the tail.
  const int m_block = kIsCausal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = T::kTmaBytesKV;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;  // the thread that issues the loads
  pipe_params.num_consumers = 128 * T::kConsumerWarpgroups;
  if (threadIdx.x == 0) {
    shared.barrier_q.init(1);
    prefetch_tma_descriptor(kp.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(kp.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(kp.tma_v.get_tma_descriptor());
  }
  Pipeline pipe_k(shared.pipeline_k, pipe_params, typename T::ClusterShape{});
  Pipeline pipe_v(shared.pipeline_v, pipe_params, typename T::ClusterShape{});
  find_key_tiles<T, kIsCausal>(kp.attn, m_block, b, shared.key_tiles);
  __syncthreads();  // barriers initialized before anyone waits on them; the key tiles written

  // Each role reads the key tiles from shared memory after setmaxnreg: a value live across it
  // would have to fit the producer's 24 registers too (ptxas spills it otherwise).
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x / 32 == 0 && cute::elect_one_sync()) {
      const bounds::TileRange tiles{shared.key_tiles[0], shared.key_tiles[1]};
      produce<T, kIsCausal>(kp, shared, pipe_k, pipe_v, tiles, m_block, h, b);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    const bounds::TileRange tiles{shared.key_tiles[0], shared.key_tiles[1]};
    consume<T, RawElement>(kp.attn, shared, pipe_k, pipe_v, tiles, m_block, h, b);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // a device pass without sm_90a (e.g. plain sm_90 beside 9.0a): fail loudly, never return nothing
#endif
}

// A TMA descriptor of one [batch, heads, seqlen, dim] operand, tiled as `smem_layout`.
template <typename Traits, typename SmemLayout, typename Tile>
auto make_tma(const void* ptr, int64_t seqlen, int64_t dim, int64_t heads, int64_t batch, int64_t row_stride,
              int64_t head_stride, int64_t batch_stride, SmemLayout smem_layout, Tile tile) {
  Tensor g = make_tensor(make_gmem_ptr(static_cast<const typename Traits::Element*>(ptr)),
                         make_shape(int32_t(seqlen), int32_t(dim), int32_t(heads), int32_t(batch)),
                         make_stride(row_stride, _1{}, head_stride, batch_stride));
  return make_tma_copy(SM90_TMA_LOAD{}, g, smem_layout, tile, _1{});
}

// Host launcher: builds the TMA descriptors from the params' pointers and strides, and launches
// one block per (128 query rows, head, batch). The caller checked supports(params).
template <typename Element, int kHeadDim, bool kIsCausal>
cudaError_t run_flash_fwd_sm90_(const AttentionParams& p, cudaStream_t stream) {
  using T = FwdTraits<typename CutlassElement<Element>::type, kHeadDim, kIsCausal>;
  if (!supports(p) || p.head_dim != kHeadDim) {
    return cudaErrorInvalidValue;
  }
  const int64_t heads_k = p.num_heads_k > 0 ? p.num_heads_k : p.num_heads;
  const FwdKernelParams<T> kp{
      p,
      make_tma<T>(p.q, p.seqlen_q, p.head_dim, p.num_heads, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride,
                  typename T::SmemLayoutQ{}, Shape<typename T::BlockM, typename T::HeadDim>{}),
      make_tma<T>(p.k, p.seqlen_k, p.head_dim, heads_k, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride,
                  take<0, 2>(typename T::SmemLayoutK{}), Shape<typename T::BlockN, typename T::HeadDim>{}),
      make_tma<T>(p.v, p.seqlen_k, p.head_dim_v, heads_k, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride,
                  take<0, 2>(typename T::SmemLayoutV{}), Shape<typename T::BlockN, typename T::HeadDim>{}),
  };
  const dim3 grid(static_cast<unsigned>((p.seqlen_q + T::kBlockM - 1) / T::kBlockM), static_cast<unsigned>(p.num_heads),
                  static_cast<unsigned>(p.batch));
  return launch_kernel(flash_fwd_sm90_kernel<T, Element, kIsCausal>, grid, dim3(T::kThreads), T::kSmemBytes, stream, kp);
}

}  // namespace attn_export::cuda::sm90
