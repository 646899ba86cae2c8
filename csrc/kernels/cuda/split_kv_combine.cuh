// The combine step of split-KV (split_kv.h): merges the chunks' partial outputs of each query
// row by their log-sum-exp weights into out (the input dtype) and lse (float32). One warp per
// row: the lanes reduce the chunks' lse (max, then the sum of exponentials), then each lane
// accumulates its columns over the chunks. All arithmetic in float32, from float32 partials.
#pragma once

#include "element.cuh"
#include "launch.h"
#include "split_kv.h"

namespace attn_export::cuda {
namespace device {

inline constexpr int kCombineWarps = 4;

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

template <typename Element>
__global__ void __launch_bounds__(kCombineWarps * 32) split_kv_combine_kernel(const AttentionParams params,
                                                                             const SplitKv split) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = params.batch * params.num_heads * params.seqlen_q;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  if (r >= rows) {
    return;  // the whole warp: r is the same for its 32 lanes
  }
  const int dim_v = static_cast<int>(params.head_dim_v), chunks = split.num_splits;
  const float* chunk_lse = split.lse_accum + r;  // chunk s at chunk_lse[s * rows]

  float mx = neg_inf<float>();
  for (int s = lane; s < chunks; s += 32) {
    mx = fmaxf(mx, chunk_lse[s * rows]);
  }
  mx = warp_max(mx);
  // No chunk saw a key of this row: every weight is exp(-inf - m) for any finite m = 0.
  const float m_use = mx == neg_inf<float>() ? 0.f : mx;
  float sum = 0.f;
  for (int s = lane; s < chunks; s += 32) {
    sum += expf(chunk_lse[s * rows] - m_use);
  }
  sum = warp_sum(sum);
  const bool visible = sum > 0.f;
  const float lse = visible ? m_use + logf(sum) : neg_inf<float>();

  const int64_t i = r % params.seqlen_q, bh = r / params.seqlen_q;
  const int64_t h = bh % params.num_heads, b = bh / params.num_heads;
  Element* out = static_cast<Element*>(params.out) + b * params.out_batch_stride + h * params.out_head_stride +
      i * params.out_row_stride;
  for (int c = lane; c < dim_v; c += 32) {
    float acc = 0.f;
    for (int s = 0; s < chunks; ++s) {
      const float w = visible ? expf(chunk_lse[s * rows] - lse) : 0.f;
      acc += w == 0.f ? 0.f : w * split.out_accum[(s * rows + r) * dim_v + c];
    }
    out[c] = from_acc<Element>(acc);
  }
  if (lane == 0) {
    static_cast<float*>(params.lse)[r] = lse;
  }
}

}  // namespace device

template <typename Element>
cudaError_t run_split_kv_combine(const AttentionParams& params, const SplitKv& split, cudaStream_t stream) {
  const int64_t rows = params.batch * params.num_heads * params.seqlen_q;
  const unsigned blocks = static_cast<unsigned>((rows + device::kCombineWarps - 1) / device::kCombineWarps);
  return launch_kernel(device::split_kv_combine_kernel<Element>, dim3(blocks), dim3(device::kCombineWarps * 32), 0,
                       stream, params, split);
}

}  // namespace attn_export::cuda
