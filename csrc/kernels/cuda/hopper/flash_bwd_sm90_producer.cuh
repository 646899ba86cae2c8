// The Hopper backward's producer (flash_bwd_sm90_kernel.cuh): one thread of warpgroup 0 loads
// K and V of the block once, then Q, dO, lse2 and delta of every query block that can see these
// keys (block_bounds.h), for every query head of the group, into the pipeline's stages.
#pragma once

#include "../block_bounds.h"
#include "flash_bwd_sm90_traits.cuh"

namespace attn_export::cuda::sm90 {
namespace bwd {

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
  const bounds::TileRange seen_by = bounds::query_blocks<T::kBlockM, T::kBlockN, kIsCausal>(p, n_block * T::kBlockN);
  const int m_begin = seen_by.begin, m_end = seen_by.end;
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

}  // namespace bwd
}  // namespace attn_export::cuda::sm90
