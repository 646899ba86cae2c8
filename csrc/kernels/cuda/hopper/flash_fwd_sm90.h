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
#include "../kernel_traits.h"

namespace attn_export::cuda::sm90 {

// The compiled head dims (head_dim == head_dim_v, exactly: no padded columns): every head dim the
// sm80 path's tensor-core kernels compile. Each is 4 instantiations of a CuTe kernel (~15-40 s
// of nvcc each); the tile table (fwd_tile below) sizes their tiles.
inline constexpr int kHeadDims[] = {32, 64, 96, 128, 192, 256};
inline constexpr int kNumHeadDims = sizeof(kHeadDims) / sizeof(kHeadDims[0]);

inline bool compiled_head_dim(int64_t head_dim, int64_t head_dim_v) {
  return equal_head_dims_in(kHeadDims, head_dim, head_dim_v);
}

// The tile table: key-tile rows, K/V ring depth and the two scheduling switches of the sm_90a
// kernel (flash_fwd_sm90_traits.cuh) per head dim and causality, after FlashAttention-3's
// tile_size.h, within this kernel's shape: 128 query rows in 2 consumer warpgroups of 240
// registers (FA3 runs 192 rows in 3 warpgroups at head dims <= 96), shared memory <= 227 KB.
//   d <= 96: 128 keys, 3 stages; ping-pong and overlap.
//   d 128:   128 keys, 2 stages; ping-pong and overlap. FA3's 176 keys where not causal spilled
//            ~800 bytes here (S 88 + P 44 + O 64 registers beside the mask code).
//   d 192:   112 keys, 2 stages (48 + 4 x 42 = 216 KB: FA3's size); serial.
//   d 256:    80 keys, 2 stages (64 + 4 x 40 = 224 KB: FA3's size); serial.
// ping_pong: the two consumer warpgroups take turns issuing their GEMMs (named barriers), so that
// one's softmax runs while the other's GEMMs hold the tensor cores; FA3 keeps it to head dims
// <= 128, where the softmax is the larger share of a tile's time. overlap: inside a warpgroup,
// tile n+1's Q K^T and tile n's P V are issued together and tile n+1's softmax runs while P V
// executes. At 192 and 256 the overlap holds P beside O (96 or 128 floats) and spilled (124 and
// 164 bytes), so those run serially. Either switch can be flipped here for a GPU A/B run; the
// offline gate checks that the SASS follows them (tests/ops/cuda/test_cuda_sm90_build.py).
struct FwdTile {
  int block_n;
  int stages;
  bool ping_pong;
  bool overlap;
};

constexpr FwdTile fwd_tile(int head_dim, [[maybe_unused]] bool causal) {
  if (head_dim <= 96) {
    return {128, 3, true, true};
  }
  if (head_dim <= 128) {
    return {128, 2, true, true};
  }
  if (head_dim <= 192) {
    return {112, 2, false, false};
  }
  return {80, 2, false, false};
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
  // No ALiBi in the sm_90a kernels yet: slopes go to the sm80 forward, which adds them.
  return half && p.alibi_slopes == nullptr && compiled_head_dim(p.head_dim, p.head_dim_v) && p.seqlen_q > 0 && p.seqlen_k > 0 &&
      tma_operand_ok(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
      tma_operand_ok(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
      tma_operand_ok(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride) && out_ok && p.lse != nullptr;
}

// Host launcher, instantiated per (dtype, head dim, causal) in instantiations/sm90_flash_fwd_*.cu.
template <typename Element, int kHeadDim, bool kIsCausal>
cudaError_t run_flash_fwd_sm90_(const AttentionParams& params, cudaStream_t stream);

}  // namespace attn_export::cuda::sm90
