// The Hopper backward's first kernel (flash_bwd_sm90_kernel.cuh): per query row, delta =
// rowsum(dO * O) and lse2 = lse * log2(e) (+inf for a row that sees no key), into the padded
// workspace rows that the main kernel's producer copies per query block (cp.async.bulk).
#pragma once

#include "../element.cuh"
#include "flash_bwd_sm90_traits.cuh"

namespace attn_export::cuda::sm90 {
namespace bwd {

// One warp per (padded) query row.
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

}  // namespace bwd
}  // namespace attn_export::cuda::sm90
