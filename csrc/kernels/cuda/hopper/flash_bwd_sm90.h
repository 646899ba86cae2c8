// The Hopper (sm_90a) flash backward: what it runs, its tiles, its workspace and the launcher's
// declaration. Host code only, no CuTe: attention_cuda.cu includes this to dispatch and size the
// workspace, and a test compiles it alone (tests/ops/cuda/test_cuda_sm90_build.py).
//
// The kernel (flash_bwd_sm90_kernel.cuh) is built only when the arch list holds 9.0a and the
// CUTLASS/CuTe headers were found (ATTN_EXPORT_WITH_SM90, as the forward); it runs only on a
// compute-capability-9 device with its preview switches on (dispatch_policy.h, kHopperBackward):
// it has not yet run on a GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../../../attention_params.h"
#include "flash_fwd_sm90.h"

namespace attn_export::cuda::sm90 {

// The tile table: one row per compiled head dim (head_dim == head_dim_v). block_m query rows
// stream past block_n keys per thread block; two MMA warpgroups own block_n / 2 keys each and
// keep their dK and dV (2 x 64 x head_dim floats per warpgroup) in registers. d128 takes 64-row
// query blocks so that S^T, dP^T (2 x 32), dK, dV (2 x 64) and a dQ slice (32) fit 240 registers;
// d64 takes 128-row blocks (S^T, dP^T 2 x 64, dK, dV 2 x 32, dQ 32). d32 and d96 take d64's and
// d128's tiles (FlashAttention-3's d96 tile): d32 S^T, dP^T 2 x 64, dK, dV 2 x 16, dQ 16; d96
// S^T, dP^T 2 x 32, dK, dV 2 x 48, dQ 24 (half of the 96 columns).
//
// swap_dkv (head dims 192 and 256): dK and dV of 64 keys per warpgroup would take 2 x 96 or 2 x
// 128 registers, so these rows take 64 x 64 tiles and compute dK^T and dV^T (head dim x keys,
// the warpgroups splitting the 64 keys: 2 x 48 or 2 x 64 registers), with P^T and dS^T through
// shared memory as their B operands, as FlashAttention-3 does at d256 (docs/cuda.md).
struct BwdTile {
  int head_dim, block_m, block_n;
  bool swap_dkv;
};
inline constexpr BwdTile kBwdTiles[] = {{32, 128, 128, false}, {64, 128, 128, false}, {96, 64, 128, false},
                                        {128, 64, 128, false}, {192, 64, 64, true}, {256, 64, 64, true}};
inline constexpr int kNumBwdTiles = sizeof(kBwdTiles) / sizeof(kBwdTiles[0]);

inline constexpr BwdTile bwd_tile(int head_dim) {
  for (const BwdTile& t : kBwdTiles) {
    if (t.head_dim == head_dim) {
      return t;
    }
  }
  return BwdTile{0, 0, 0, false};
}

inline int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// Whether the Hopper backward can run these params (device and switches are the dispatch's
// business): 16-bit, a tiled head dim, TMA-describable q, k, v and dO, gradients whose rows take
// 4-byte paired stores, whole groups of query heads per key/value head, and no gradient of the
// returned weights (that term, dP += dW, stays on the sm80 path, which computes it).
inline bool supports_backward(const AttentionBackwardParams& p) {
  const bool half = p.dtype == DataType::kFloat16 || p.dtype == DataType::kBFloat16;
  const auto pairs_ok = [](const void* ptr, int64_t b, int64_t h, int64_t r) {
    return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 4 == 0 && b % 2 == 0 && h % 2 == 0 && r % 2 == 0;
  };
  const int64_t heads_k = p.num_heads_k > 0 ? p.num_heads_k : p.num_heads;
  // No ALiBi in the sm_90a kernels yet: slopes go to the sm80 backward, which adds them.
  return half && p.alibi_slopes == nullptr && p.head_dim == p.head_dim_v && bwd_tile(static_cast<int>(p.head_dim)).head_dim != 0 &&
      p.seqlen_q > 0 && p.seqlen_k > 0 && heads_k > 0 && p.num_heads % heads_k == 0 && p.grad_weights == nullptr &&
      p.lse != nullptr && p.out != nullptr &&
      tma_operand_ok(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
      tma_operand_ok(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
      tma_operand_ok(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride) &&
      tma_operand_ok(p.grad_out, p.grad_out_batch_stride, p.grad_out_head_stride, p.grad_out_row_stride) &&
      pairs_ok(p.grad_q, p.grad_q_batch_stride, p.grad_q_head_stride, p.grad_q_row_stride) &&
      pairs_ok(p.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride, p.grad_k_row_stride) &&
      pairs_ok(p.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride, p.grad_v_row_stride);
}

// The backward's workspace, in this order, each part 256-byte aligned:
//   lse2   [batch, heads, Lq rounded up to block_m] float: lse * log2(e), +inf where lse = -inf
//          and on the padding rows (so every probability there is exactly 0), for 1-D TMA copies
//   delta  [batch, heads, Lq rounded] float: rowsum(dO * O), 0 on the padding rows
//   dq     [batch, heads, Lq rounded, head_dim] float: dQ accumulated over the key blocks
//   order  [batch, heads, Lq / block_m] int: deterministic mode only, which key block adds to
//          each query block's dQ next (the key blocks take turns in index order)
struct BwdWorkspace {
  size_t lse2 = 0, delta = 0, dq = 0, order = 0;
  size_t total() const { return lse2 + delta + dq + order; }
};

inline size_t round_up_256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

inline BwdWorkspace bwd_workspace(const AttentionBackwardParams& p) {
  BwdWorkspace w;
  const int block_m = bwd_tile(static_cast<int>(p.head_dim)).block_m;
  if (block_m == 0) {
    return w;
  }
  const size_t rows = static_cast<size_t>(p.batch * p.num_heads * round_up(p.seqlen_q, block_m));
  w.lse2 = round_up_256(rows * sizeof(float));
  w.delta = w.lse2;
  w.dq = round_up_256(rows * static_cast<size_t>(p.head_dim) * sizeof(float));
  if (p.deterministic) {
    w.order = round_up_256(rows / block_m * sizeof(int));
  }
  return w;
}

// Host launcher, instantiated per (dtype, head dim, causal) in instantiations/sm90_flash_bwd_*.cu.
// `workspace` holds bwd_workspace(params).total() bytes; the caller checked supports_backward().
template <typename Element, int kHeadDim, bool kIsCausal>
cudaError_t run_flash_bwd_sm90_(const AttentionBackwardParams& params, void* workspace, cudaStream_t stream);

}  // namespace attn_export::cuda::sm90
