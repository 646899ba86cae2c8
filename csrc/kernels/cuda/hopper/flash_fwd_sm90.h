// The Hopper (sm_90a) flash forward: what it runs and the launcher's declaration. Host code
// only, no CuTe: attention_cuda.cu includes this to dispatch, and a test compiles it alone.
//
// The kernel (flash_fwd_sm90_kernel.cuh) is built only when the arch list holds 9.0a and the
// CUTLASS/CuTe headers were found (setup.py, csrc/CMakeLists.txt define ATTN_EXPORT_WITH_SM90);
// it runs only on a compute-capability-9 device with its preview switch on (dispatch_policy.h,
// kHopperForward): it has not yet run on a GPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../../../attention_params.h"

namespace attn_export::cuda::sm90 {

// The compiled head dims (head_dim == head_dim_v, exactly: no padded columns): every head dim the
// sm80 path's tensor-core kernels compile. Each is 4 instantiations of a CuTe kernel (~15-40 s
// of nvcc each); the tile table (flash_fwd_sm90_traits.cuh, fwd_tile) sizes their tiles.
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};
inline constexpr int kNumHeadDims = sizeof(kHeadDims) / sizeof(kHeadDims[0]);

inline bool compiled_head_dim(int64_t head_dim, int64_t head_dim_v) {
  if (head_dim != head_dim_v) {
    return false;
  }
  for (int d : kHeadDims) {
    if (head_dim == d) {
      return true;
    }
  }
  return false;
}

// What the tensor memory accelerator requires of a [batch, heads, seqlen, dim] operand of 2-byte
// elements: a 16-byte aligned base, unit stride on the head dim (AttentionParams' convention),
// and the other strides positive multiples of 16 bytes (8 elements) below 2^40 bytes.
inline bool tma_operand_ok(const void* ptr, int64_t batch_stride, int64_t head_stride, int64_t row_stride) {
  constexpr int64_t kElems = 8;
  constexpr int64_t kMaxStride = (int64_t{1} << 40) / 2;
  const auto ok = [](int64_t s) { return s > 0 && s % kElems == 0 && s < kMaxStride; };
  return ptr != nullptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && ok(batch_stride) && ok(head_stride) &&
      ok(row_stride);
}

// Whether the Hopper forward can run these params (the device and the preview are the
// dispatch's business): 16-bit q/k/v at a compiled head dim, operands TMA can describe, and an
// output whose rows take the kernel's 4-byte paired stores. Anything else runs on the sm80 path.
inline bool supports(const AttentionParams& p) {
  const bool half = p.dtype == DataType::kFloat16 || p.dtype == DataType::kBFloat16;
  const bool out_ok = p.out != nullptr && reinterpret_cast<uintptr_t>(p.out) % 16 == 0 &&
      p.out_row_stride % 8 == 0 && p.out_head_stride % 8 == 0 && p.out_batch_stride % 8 == 0;
  return half && compiled_head_dim(p.head_dim, p.head_dim_v) && p.seqlen_q > 0 && p.seqlen_k > 0 &&
      tma_operand_ok(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
      tma_operand_ok(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
      tma_operand_ok(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride) && out_ok && p.lse != nullptr;
}

// Host launcher, instantiated per (dtype, head dim, causal) in instantiations/sm90_flash_fwd_*.cu.
template <typename Element, int kHeadDim, bool kIsCausal>
cudaError_t run_flash_fwd_sm90_(const AttentionParams& params, cudaStream_t stream);

}  // namespace attn_export::cuda::sm90
