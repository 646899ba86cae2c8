// Entry points of the CUDA attention kernels: validation, the choice between the flash
// (tensor-core) and generic kernels, and the one switch that turns runtime choices (dtype,
// head dim, causality) into template arguments. No kernel is compiled in this file; each
// instantiation lives in its own translation unit (see attention_launchers.h).
#include "attention_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention_launchers.h"
#include "kernel_traits.h"

namespace attn_export::cuda {
namespace {

template <typename T>
struct Type {
  using type = T;
};

template <typename T>
inline constexpr bool kIs16Bit = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

// ---- The one switch: each runtime choice becomes a template argument here and nowhere else.

template <typename F>
cudaError_t switch_dtype(DataType dtype, F&& f) {
  switch (dtype) {
    case DataType::kFloat16:
      return f(Type<__half>{});
    case DataType::kBFloat16:
      return f(Type<__nv_bfloat16>{});
    case DataType::kFloat32:
      return f(Type<float>{});
    case DataType::kFloat64:
      return f(Type<double>{});
  }
  return cudaErrorInvalidValue;
}

// The compiled head dims are kFlashHeadDims (kernel_traits.h), walked at compile time.
template <int kIndex = 0, typename F>
cudaError_t switch_flash_head_dim(int64_t tile_dim, F&& f) {
  if constexpr (kIndex == kNumFlashHeadDims) {
    return cudaErrorInvalidValue;
  } else {
    if (tile_dim == kFlashHeadDims[kIndex]) {
      return f(std::integral_constant<int, kFlashHeadDims[kIndex]>{});
    }
    return switch_flash_head_dim<kIndex + 1>(tile_dim, std::forward<F>(f));
  }
}

template <typename F>
cudaError_t switch_bool(bool value, F&& f) {
  return value ? f(std::true_type{}) : f(std::false_type{});
}

// Head-dim elements per lane of the generic kernels: 32 * kRegs >= max(head_dim, head_dim_v).
template <typename F>
cudaError_t switch_generic_regs(int64_t max_dim, F&& f) {
  if (max_dim <= 64) {
    return f(std::integral_constant<int, 2>{});
  }
  if (max_dim <= 128) {
    return f(std::integral_constant<int, 4>{});
  }
  if (max_dim <= 256) {
    return f(std::integral_constant<int, 8>{});
  }
  return f(std::integral_constant<int, 16>{});
}

// ---- Path selection.

// Compute capability major of the current device, cached per device.
int device_major() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    return 0;
  }
  int major = cache[device].load(std::memory_order_relaxed);
  if (major == 0) {
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      return 0;
    }
    cache[device].store(major, std::memory_order_relaxed);
  }
  return major;
}

// Every row of a 16-bit [batch, heads, seqlen, dim] operand starts on a 16-byte boundary, as
// cp.async (16-byte copies) and the paired stores of the flash kernels require.
bool rows_16b_aligned(const void* ptr, int64_t batch_stride, int64_t head_stride, int64_t row_stride) {
  constexpr int64_t kElems = 8;  // 16 bytes of 2-byte elements
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && batch_stride % kElems == 0 &&
      head_stride % kElems == 0 && row_stride % kElems == 0;
}

bool flash_backward(const AttentionBackwardParams& p) {
  return attention_uses_tensor_cores(p) &&
      rows_16b_aligned(p.grad_out, p.grad_out_batch_stride, p.grad_out_head_stride, p.grad_out_row_stride) &&
      rows_16b_aligned(p.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride, p.grad_k_row_stride) &&
      rows_16b_aligned(p.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride, p.grad_v_row_stride);
}

bool valid_dtype(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kFloat16 || dtype == DataType::kBFloat16 ||
      dtype == DataType::kFloat64;
}

bool valid_mask(const AttentionMask& m) {
  if (!m.present()) {
    return m.kind == MaskKind::kNone || m.kind == MaskKind::kBool || m.kind == MaskKind::kAdditive;
  }
  return m.kind == MaskKind::kBool || (m.kind == MaskKind::kAdditive && valid_dtype(m.dtype));
}

int64_t max_head_dim(const AttentionParams& p) {
  return p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
}

// The compiled flash head dim a problem runs on, its columns past head_dim (q, k) and
// head_dim_v (v, out) masked; 0 when none fits. Both dims must be multiples of 8 elements (16
// bytes): the padded loads and stores work in 16-byte chunks and element pairs.
int flash_tile_dim(const AttentionParams& p) {
  const bool chunked = p.head_dim > 0 && p.head_dim_v > 0 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0;
  return chunked ? flash_tile_head_dim(max_head_dim(p)) : 0;
}

// ---- Backward workspace: [delta: batch*heads*seqlen_q accumulation type]
//                           [dq_accum: batch*heads*seqlen_q*head_dim float, flash path only]

size_t round_up_256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

struct WorkspaceLayout {
  size_t delta_bytes = 0;
  size_t dq_accum_bytes = 0;
  size_t total() const { return delta_bytes + dq_accum_bytes; }
};

WorkspaceLayout workspace_layout(const AttentionBackwardParams& p) {
  WorkspaceLayout layout;
  const size_t rows = static_cast<size_t>(p.batch * p.num_heads * p.seqlen_q);
  const size_t acc_size = p.dtype == DataType::kFloat64 ? sizeof(double) : sizeof(float);
  layout.delta_bytes = round_up_256(rows * acc_size);
  if (flash_backward(p)) {
    layout.dq_accum_bytes = round_up_256(rows * static_cast<size_t>(p.head_dim) * sizeof(float));
  }
  return layout;
}

}  // namespace

const char* attention_params_error(const AttentionParams& p) {
  if (!valid_dtype(p.dtype)) {
    return "attention (CUDA): unsupported dtype; use float16, bfloat16, float32 or float64";
  }
  if (p.batch < 0 || p.num_heads < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.head_dim < 0 ||
      p.head_dim_v < 0) {
    return "attention (CUDA): sizes must be non-negative";
  }
  if (max_head_dim(p) > kMaxHeadDim) {
    return "attention (CUDA): head_dim and head_dim_v above 512 are not supported";
  }
  if (p.batch > 65535 || p.num_heads > 65535) {
    return "attention (CUDA): batch and num_heads must each be at most 65535 (CUDA grid limits)";
  }
  constexpr int64_t kMaxSeqlen = std::numeric_limits<int32_t>::max() - 1024;
  if (p.seqlen_q > kMaxSeqlen || p.seqlen_k > kMaxSeqlen) {
    return "attention (CUDA): sequence lengths must be below 2^31";
  }
  if (!valid_mask(p.attn_mask) || !valid_mask(p.key_padding_mask)) {
    return "attention (CUDA): masks must be bool (one byte per element) or float16, bfloat16, "
           "float32 or float64";
  }
  return nullptr;
}

bool attention_uses_tensor_cores(const AttentionParams& p) {
  const bool dtype_ok = p.dtype == DataType::kFloat16 || p.dtype == DataType::kBFloat16;
  const bool dims_ok = flash_tile_dim(p) != 0;
  return dtype_ok && dims_ok &&
      rows_16b_aligned(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride) &&
      rows_16b_aligned(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride) &&
      rows_16b_aligned(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride) &&
      rows_16b_aligned(p.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride) &&
      device_major() >= 8;
}

cudaError_t run_attention_forward(const AttentionParams& p, cudaStream_t stream) {
  if (attention_params_error(p) != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.num_heads == 0 || p.seqlen_q == 0) {
    return cudaSuccess;
  }
  const bool flash = attention_uses_tensor_cores(p);
  return switch_dtype(p.dtype, [&](auto type) -> cudaError_t {
    using T = typename decltype(type)::type;
    return switch_generic_regs(max_head_dim(p), [&](auto regs) -> cudaError_t {
      cudaError_t err = cudaSuccess;
      if constexpr (kIs16Bit<T>) {
        if (flash) {
          err = switch_flash_head_dim(flash_tile_dim(p), [&](auto dim) {
            return switch_bool(p.is_causal, [&](auto causal) {
              return run_flash_fwd_<T, decltype(dim)::value, decltype(causal)::value>(p, stream);
            });
          });
        }
      }
      if (!flash) {
        err = run_generic_fwd<T, decltype(regs)::value>(p, stream);
      }
      if (err == cudaSuccess && p.weights != nullptr) {
        err = run_generic_weights<T, decltype(regs)::value>(p, stream);
      }
      return err;
    });
  });
}

size_t attention_backward_workspace_size(const AttentionBackwardParams& p) {
  return workspace_layout(p).total();
}

cudaError_t run_attention_backward(const AttentionBackwardParams& p, void* workspace, cudaStream_t stream) {
  if (attention_params_error(p) != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.num_heads == 0) {
    return cudaSuccess;
  }
  const bool flash = flash_backward(p);
  const WorkspaceLayout layout = workspace_layout(p);
  return switch_dtype(p.dtype, [&](auto type) -> cudaError_t {
    using T = typename decltype(type)::type;
    using Acc = acc_t<T>;
    Acc* delta = static_cast<Acc*>(workspace);
    return switch_generic_regs(max_head_dim(p), [&](auto regs) -> cudaError_t {
      constexpr int kRegs = decltype(regs)::value;
      cudaError_t err = run_generic_delta<T, kRegs>(p, delta, stream);
      if (err != cudaSuccess) {
        return err;
      }
      if constexpr (kIs16Bit<T>) {
        if (flash) {
          float* dq_accum = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + layout.delta_bytes);
          err = cudaMemsetAsync(dq_accum, 0, layout.dq_accum_bytes, stream);
          if (err != cudaSuccess) {
            return err;
          }
          return switch_flash_head_dim(flash_tile_dim(p), [&](auto dim) {
            return switch_bool(p.is_causal, [&](auto causal) {
              return run_flash_bwd_<T, decltype(dim)::value, decltype(causal)::value>(p, dq_accum, delta, stream);
            });
          });
        }
      }
      return run_generic_bwd<T, kRegs>(p, delta, stream);
    });
  });
}

}  // namespace attn_export::cuda
