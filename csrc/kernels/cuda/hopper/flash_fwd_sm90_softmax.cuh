// Register-side pieces of the Hopper forward's consumers: views of the wgmma accumulators by
// (row, column), the accumulator-to-operand conversion that keeps P in registers, one wgmma
// batch, and the online softmax (FlashAttention-2/3 style, log2 domain, fp32).
#pragma once

#include <cute/tensor.hpp>

#include "../device_primitives.cuh"
#include "../element.cuh"

namespace attn_export::cuda::sm90 {

using namespace cute;

// A wgmma accumulator layout ((2, 2, N/8), MMA_M, MMA_N) as (rows, columns): ((2, MMA_M),
// (2, N/8, MMA_N)). Each thread holds 2 rows per 64-row slab; a row's values sit in the 4
// threads of a quad, so row reductions are two shuffles.
template <typename Layout>
CUTE_HOST_DEVICE auto rowcol(Layout acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "a wgmma accumulator layout");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The same registers as the A operand of a register-sourced 16-bit wgmma: ((2, 2, 2), MMA_M,
// N/16). Two adjacent 8-column accumulator tiles are exactly one 16-deep K step of A.
template <typename Layout>
CUTE_HOST_DEVICE auto acc_as_operand_a(Layout acc) {
  auto l = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(l), get<1>(l), get<2, 0>(l)), get<1>(acc), get<2, 1>(l));
}

// One warpgroup-wide GEMM C (+)= A B, issued as one wgmma batch. kZeroInit: C starts at zero
// (the first K step overwrites it). kWait: wait for it here; otherwise the batch stays in flight
// (committed as one group) and the caller waits with warpgroup_wait<n>() and fences C after, and
// must not touch A's registers or C until then.
template <bool kZeroInit, bool kWait = true, typename TiledMma, typename TA, typename TB, typename TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TA& a, const TB& b, TC& c) {
  constexpr bool kRegisterA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegisterA) {
    warpgroup_fence_operand(a);
  }
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(c);
    if constexpr (kRegisterA) {
      warpgroup_fence_operand(a);
    }
  }
}

// Running max and sum of a thread's kRows rows. Scores are in the log2 domain (scale * log2(e)
// folded in) so each probability is one ex2.
template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // this thread's partial sums; the quad reduces them at the end

  __device__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = device::neg_inf<float>();
      row_sum[r] = 0.f;
    }
  }

  // s: this tile's scores (rows, cols), replaced by their probabilities relative to the new
  // running max; correction: what the output accumulated so far must be multiplied by.
  template <typename TS>
  __device__ __forceinline__ void update(TS& s, float (&correction)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float mx = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        mx = fmaxf(mx, s(r, c));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // A row that has seen no visible key keeps max = -inf; subtracting 0 keeps its exponents
      // at -inf (never -inf - -inf = NaN), so its probabilities and correction are 0.
      const float m_use = mx == device::neg_inf<float>() ? 0.f : mx;
      correction[r] = device::fast_exp2(row_max[r] - m_use);
      row_max[r] = mx;
      float sum = row_sum[r] * correction[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = device::fast_exp2(s(r, c) - m_use);
        sum += s(r, c);
      }
      row_sum[r] = sum;
    }
  }
};

// o: the output accumulator (rows, cols), rescaled by OnlineSoftmax::update()'s correction.
template <typename TO, int kRows>
__device__ __forceinline__ void rescale_rows(TO& o, const float (&correction)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o); ++c) {
      o(r, c) *= correction[r];
    }
  }
}

}  // namespace attn_export::cuda::sm90
