// Entry points of the CUDA attention kernels: validation, the choice between the flash
// (tensor-core) and generic kernels, and the one switch that turns runtime choices (dtype,
// head dim, causality) into template arguments. No kernel is compiled in this file; each
// instantiation lives in its own translation unit (see attention_launchers.h).
#include "attention_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <type_traits>

#include "attention_launchers.h"
#include "dispatch_policy.h"
#include "forward_plan.h"
#include "kernel_traits.h"
#include "split_kv.h"
#if defined(ATTN_EXPORT_WITH_SM90)
#include "hopper/flash_bwd_sm90.h"
#include "hopper/flash_fwd_sm90.h"
#endif

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

// ---- The preview switch (dispatch_policy.h): -1 until first read.

std::atomic<int> g_preview{-1};

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

// Streaming multiprocessors of the current device (not cached: the query is a host-side lookup).
int device_sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return count;
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

// The compiled flash head dim a problem runs on (forward_plan.h), at this process's preview switch.
int flash_tile_dim(const AttentionParams& p) {
  return cuda::flash_tile_dim(p, attention_preview_enabled());
}

// ---- The Hopper forward (dispatch_policy.h kHopperForward; built with ATTN_EXPORT_WITH_SM90 only).

#if defined(ATTN_EXPORT_WITH_SM90)
// The compiled head dims of the sm_90a forward (sm90::kHeadDims), walked at compile time.
template <typename T, bool kCausal, int kIndex = 0>
cudaError_t run_sm90_head_dim(const AttentionParams& p, cudaStream_t stream) {
  if constexpr (kIndex == sm90::kNumHeadDims) {
    return cudaErrorInvalidValue;
  } else {
    if (p.head_dim == sm90::kHeadDims[kIndex]) {
      return sm90::run_flash_fwd_sm90_<T, sm90::kHeadDims[kIndex], kCausal>(p, stream);
    }
    return run_sm90_head_dim<T, kCausal, kIndex + 1>(p, stream);
  }
}

// Runs the sm_90a forward when the device, the switches and the params allow it, and sets `ran`.
// Returned attention weights (a debugging output) stay on the sm80 path, which computes them;
// so does decode-shaped work, where the sm80 forward's plan splits the keys (given `available`
// bytes of workspace) or packs grouped query heads (forward_plan.h hopper_forward_declines).
cudaError_t try_sm90_forward(const AttentionParams& p, const FlashFwdPlan& plan, size_t available, cudaStream_t stream,
                             bool& ran) {
  static const bool sm90_switch = policy::preview_from_env(std::getenv(policy::kSm90EnvVar));
  ran = p.weights == nullptr && policy::hopper_forward_allowed(device_major(), attention_preview_enabled(), sm90_switch) &&
      sm90::supports(p) && !hopper_forward_declines(plan, p, available);
  if (!ran) {
    return cudaSuccess;
  }
  return switch_dtype(p.dtype, [&](auto type) -> cudaError_t {
    using T = typename decltype(type)::type;
    if constexpr (kIs16Bit<T>) {
      return switch_bool(p.is_causal, [&](auto causal) {
        return run_sm90_head_dim<T, decltype(causal)::value>(p, stream);
      });
    }
    return cudaErrorInvalidValue;  // supports() admits 16-bit types only
  });
}
#endif

// ---- The Hopper backward (dispatch_policy.h kHopperBackward; built with ATTN_EXPORT_WITH_SM90 only).

#if defined(ATTN_EXPORT_WITH_SM90)
// Whether run_attention_backward runs the sm_90a backward for these params; the workspace size
// asks the same question.
bool sm90_backward_runs(const AttentionBackwardParams& p) {
  static const bool sm90_switch = policy::preview_from_env(std::getenv(policy::kSm90EnvVar));
  return policy::hopper_backward_allowed(device_major(), attention_preview_enabled(), sm90_switch) &&
      sm90::supports_backward(p);
}

// The backward's tile rows (sm90::kBwdTiles), walked at compile time.
template <typename T, bool kCausal, int kIndex = 0>
cudaError_t run_sm90_bwd_head_dim(const AttentionBackwardParams& p, void* workspace, cudaStream_t stream) {
  if constexpr (kIndex == sm90::kNumBwdTiles) {
    return cudaErrorInvalidValue;
  } else {
    if (p.head_dim == sm90::kBwdTiles[kIndex].head_dim) {
      return sm90::run_flash_bwd_sm90_<T, sm90::kBwdTiles[kIndex].head_dim, kCausal>(p, workspace, stream);
    }
    return run_sm90_bwd_head_dim<T, kCausal, kIndex + 1>(p, workspace, stream);
  }
}

// The sm_90a backward into `workspace` (sm90::bwd_workspace's layout); the caller checked sm90_backward_runs.
cudaError_t run_sm90_backward(const AttentionBackwardParams& p, void* workspace, cudaStream_t stream) {
  return switch_dtype(p.dtype, [&](auto type) -> cudaError_t {
    using T = typename decltype(type)::type;
    if constexpr (kIs16Bit<T>) {
      return switch_bool(p.is_causal, [&](auto causal) {
        return run_sm90_bwd_head_dim<T, decltype(causal)::value>(p, workspace, stream);
      });
    }
    return cudaErrorInvalidValue;  // supports_backward() admits 16-bit types only
  });
}
#endif

// ---- The flash forward's plan (forward_plan.h): packed query heads, split-KV and its workspace,
// [out_accum][lse_accum] (preview only).

// The plan of problems the flash forward runs; the empty plan for the others.
FlashFwdPlan forward_plan(const AttentionParams& p, int sm_count) {
  if (attention_params_error(p) != nullptr || p.batch <= 0 || p.num_heads <= 0 || p.seqlen_q <= 0 ||
      !attention_uses_tensor_cores(p)) {
    return FlashFwdPlan{};
  }
  return flash_fwd_plan(p, flash_tile_dim(p), sm_count, attention_preview_enabled());
}

// Whether the flash forward packs each key/value head's query heads into its tiles (dispatch_policy.h).
bool packs_query_heads(const AttentionParams& p) {
  return forward_plan(p, 0).pack_gqa;  // packing does not depend on the SMs
}

// ---- Backward workspace: [delta: batch*heads*seqlen_q accumulation type]
//                           [dq_accum: batch*heads*seqlen_q*head_dim float, flash path only]

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

bool attention_preview_enabled() {
  int value = g_preview.load(std::memory_order_relaxed);
  if (value < 0) {
    int unread = -1;
    g_preview.compare_exchange_strong(unread, policy::preview_from_env(std::getenv(policy::kPreviewEnvVar)) ? 1 : 0);
    value = g_preview.load(std::memory_order_relaxed);
  }
  return value == 1;
}

void set_attention_preview(bool enabled) {
  g_preview.store(enabled ? 1 : 0, std::memory_order_relaxed);
}

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
  if (!policy::allowed(policy::needed_features(p), attention_preview_enabled())) {
    return "attention (CUDA): grouped-query heads (num_heads_k < num_heads), the bottom-right causal "
           "alignment with seqlen_q != seqlen_k, the sliding window and ALiBi slopes are not yet verified on a "
           "GPU in these kernels; set ATTN_EXPORT_CUDA_PREVIEW=1 to run them, or expand key/value to every query "
           "head and pass the causal diagonal, the window and the ALiBi bias as a mask (the PyTorch operator "
           "does this itself)";
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

bool attention_packs_query_heads(const AttentionParams& p) {
  return attention_params_error(p) == nullptr && p.batch > 0 && p.seqlen_q > 0 && packs_query_heads(p);
}

int attention_forward_block_m(const AttentionParams& p) {
  return forward_plan(p, device_sm_count()).blocks.block_m;
}

size_t attention_forward_workspace_size(const AttentionParams& p) {
  return forward_plan(p, device_sm_count()).workspace_bytes();
}

size_t attention_forward_workspace_bound(const AttentionParams& p) {
  // Whether or not the preview is on now: a host may size its workspace before the switch is
  // read for the run (a TensorRT engine is built once and run later).
  const int sm_count = device_sm_count();
  const bool half = p.dtype == DataType::kFloat16 || p.dtype == DataType::kBFloat16;
  if (!half || max_head_dim(p) > kMaxFlashHeadDim || sm_count <= 0 || p.batch <= 0 || p.num_heads <= 0 ||
      p.seqlen_q <= 0) {
    return 0;
  }
  // split_count gives chunks <= 2 * sm_count / programs + 1 with programs < sm_count, and each
  // program covers at most kBlockM rows (packed grouped-query heads or not): chunks * rows <
  // 3 * sm_count * kBlockM.
  constexpr int kBlockM = FlashFwdTraits<kMaxFlashHeadDim>::kBlockM;
  static_assert(FlashFwdTraits<kFlashHeadDims[0]>::kBlockM == kBlockM, "one kBlockM for every head dim");
  const size_t by_sms = 3 * static_cast<size_t>(sm_count) * static_cast<size_t>(kBlockM);
  const size_t by_shape = static_cast<size_t>(kMaxSplits * p.batch * p.num_heads * p.seqlen_q);
  const size_t rows = std::min(by_sms, by_shape);
  return round_up_256(rows * static_cast<size_t>(p.head_dim_v) * sizeof(float)) + round_up_256(rows * sizeof(float));
}

cudaError_t run_attention_forward(const AttentionParams& p, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  if (attention_params_error(p) != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.num_heads == 0 || p.seqlen_q == 0) {
    return cudaSuccess;
  }
  const FlashFwdPlan plan = forward_plan(p, device_sm_count());
  const size_t available = workspace != nullptr ? workspace_bytes : 0;
  AttentionParams flash_params = p;
  flash_params.skip_padded_key_tiles = policy::skip_padded_key_tiles(p, attention_preview_enabled());
#if defined(ATTN_EXPORT_WITH_SM90)
  bool sm90_ran = false;
  if (const cudaError_t err = try_sm90_forward(flash_params, plan, available, stream, sm90_ran);
      err != cudaSuccess || sm90_ran) {
    return err;
  }
#endif
  const bool flash = attention_uses_tensor_cores(p);
  SplitKv split;
  if (plan.splits(available)) {
    split.num_splits = plan.split.num_splits;
    split.blocks_per_split = plan.split.blocks_per_split;
    split.out_accum = static_cast<float*>(workspace);
    split.lse_accum = reinterpret_cast<float*>(static_cast<unsigned char*>(workspace) + plan.out_bytes);
  }
  return switch_dtype(p.dtype, [&](auto type) -> cudaError_t {
    using T = typename decltype(type)::type;
    return switch_generic_regs(max_head_dim(p), [&](auto regs) -> cudaError_t {
      cudaError_t err = cudaSuccess;
      if constexpr (kIs16Bit<T>) {
        if (flash) {
          err = switch_flash_head_dim(flash_tile_dim(p), [&](auto dim) {
            return switch_bool(p.is_causal, [&](auto causal) {
              constexpr int kDim = decltype(dim)::value;
              constexpr bool kCausal = decltype(causal)::value;
              if constexpr (wide_fwd_head_dim(kDim)) {  // the plan's 128-row blocks (never split nor packed)
                if (plan.blocks.row_tiles == kWideFwdRowTiles) {
                  return run_flash_fwd_<T, kDim, kCausal, kWideFwdRowTiles>(flash_params, split, false, stream);
                }
              }
              return run_flash_fwd_<T, kDim, kCausal>(flash_params, split, plan.pack_gqa, stream);
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
#if defined(ATTN_EXPORT_WITH_SM90)
  if (attention_params_error(p) == nullptr && sm90_backward_runs(p)) {
    return std::max(workspace_layout(p).total(), sm90::bwd_workspace(p).total());
  }
#endif
  return workspace_layout(p).total();
}

bool attention_backward_is_nondeterministic(const AttentionBackwardParams& p) {
  if (attention_params_error(p) != nullptr || p.batch == 0 || p.num_heads == 0) {
    return false;
  }
#if defined(ATTN_EXPORT_WITH_SM90)
  if (sm90_backward_runs(p)) {
    return !p.deterministic;
  }
#endif
  return flash_backward(p);
}

cudaError_t run_attention_backward(const AttentionBackwardParams& p, void* workspace, cudaStream_t stream) {
  if (attention_params_error(p) != nullptr) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0 || p.num_heads == 0) {
    return cudaSuccess;
  }
  AttentionBackwardParams flash_params = p;
  flash_params.skip_padded_key_tiles = policy::skip_padded_key_tiles(p, attention_preview_enabled());
#if defined(ATTN_EXPORT_WITH_SM90)
  if (sm90_backward_runs(p)) {
    return run_sm90_backward(flash_params, workspace, stream);
  }
#endif
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
              constexpr int kDim = decltype(dim)::value;
              constexpr bool kCausal = decltype(causal)::value;
              static_assert(kFlashBwdUnsplitHeadDim == 128, "the policy names head dim 128");
              if constexpr (kDim == kFlashBwdUnsplitHeadDim) {
                if (policy::flash_bwd_col_split_128(attention_preview_enabled()) == 1) {
                  return run_flash_bwd_<T, kDim, kCausal, 1>(flash_params, dq_accum, delta, stream);
                }
              }
              return run_flash_bwd_<T, kDim, kCausal>(flash_params, dq_accum, delta, stream);
            });
          });
        }
      }
      return run_generic_bwd<T, kRegs>(p, delta, stream);
    });
  });
}

}  // namespace attn_export::cuda
