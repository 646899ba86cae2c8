// The Hopper backward's last kernel (flash_bwd_sm90_kernel.cuh): grad_q = scale * the fp32 dQ
// that the main kernel accumulated in the workspace, in the element type.
#pragma once

#include "../element.cuh"

namespace attn_export::cuda::sm90 {
namespace bwd {

// Two columns per thread (grid-stride).
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

}  // namespace bwd
}  // namespace attn_export::cuda::sm90
