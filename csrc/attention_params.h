// The seam between the attention kernels and every binding (ATen op, TensorRT plugin).
//
// Plain data only: raw pointers, element strides, sizes and flags. Nothing here includes
// torch or TensorRT headers, so the same struct can be filled by the PyTorch op, by the
// TensorRT plugin's enqueue(), or by a unit test in plain C++.
//
// Kernels that use it: csrc/kernels/cpu/attention_cpu.h and csrc/kernels/cuda/attention_cuda.h.
//
// Layout conventions (all strides are in elements, not bytes):
//   q        [batch, num_heads, seqlen_q, head_dim]      last dim contiguous
//   k        [batch, num_heads_k, seqlen_k, head_dim]    last dim contiguous
//   v        [batch, num_heads_k, seqlen_k, head_dim_v]  last dim contiguous
//   out      [batch, num_heads, seqlen_q, head_dim_v]    last dim contiguous
//   lse      [batch, num_heads, seqlen_q]                contiguous, accumulation type
//   weights  [batch, num_heads, seqlen_q, seqlen_k]      contiguous, accumulation type, optional
//   attn_mask         broadcast to [batch, num_heads, seqlen_q, seqlen_k] (strides may be 0)
//   key_padding_mask  broadcast to [batch, seqlen_k]                      (strides may be 0)
//
// Masks follow torch.nn.MultiheadAttention: a boolean mask is true where attention is NOT
// allowed; a floating mask is added to the scaled scores. A query row with no allowed key
// (every score -inf) produces a zero output row, zero weights and lse = -inf: never NaN.
// Grouped-query attention: num_heads_k divides num_heads, and query head h reads key/value head
// kv_head(h) = h / (num_heads / num_heads_k) (num_heads_k == num_heads: multi-head attention,
// 1: multi-query attention).
//
// Causal masking lets query i attend keys j <= i + causal_shift(): top-left aligned
// (causal_alignment 0, shift 0) or bottom-right aligned (1, shift seqlen_k - seqlen_q: the last
// query sees every key, the KV-cache case). A negative shift leaves the first rows no key.
//
// ALiBi (Bloom, MPT): with alibi_slopes set, the score of query i and key j in head h gets
// alibi_bias(h, i, j) = -alibi_slopes[h] * |i + seqlen_k - seqlen_q - j| after the scale and the
// soft-cap, where the masks are added (FlashAttention's alibi_slopes: the distance is measured
// from the bottom-right diagonal whatever causal_alignment is). The slopes index QUERY heads.
#pragma once

#include <cstdint>

// The core's trailing attributes: the scalars after its masks, causality and scale, one line
// each, X(C++ type, name, default), in the order the core operators' schemas end with them
// (csrc/attention_spec.h, kSchemaAttention*). AttentionParams carries each as a field of that
// name; the torch bindings take them as the operators' last arguments and copy them here
// (csrc/ops/core_args.h expands this list), so a new attribute of the core is a line here, its
// schema text and the kernels' use of it. Types: double (schema float), int64_t (int), bool.
//
//   softcap: logit soft-capping (Gemma 2, Grok): when > 0, the scaled score x = scale * q.k
//     becomes softcap * tanh(x / softcap) BEFORE the masks are added; 0 = off. Bounds the scores
//     to (-softcap, softcap); the backward multiplies dS by 1 - tanh^2(x / softcap).
//   causal_alignment: where the causal diagonal sits when is_causal (kCausalTopLeft = 0: query i
//     sees keys j <= i; kCausalBottomRight = 1: j <= i + seqlen_k - seqlen_q). Ignored otherwise.
//   window: sliding-window causal attention (Mistral, Gemma 2's local layers, Qwen2 with
//     use_sliding_window). 0 = no window (the default); w > 0, which requires is_causal (the
//     bindings refuse it otherwise), lets query i see only the last w keys up to its causal
//     diagonal: causal_key_begin(i) <= j < causal_key_end(i), with causal_key_begin(i) =
//     i + 1 + causal_shift() - w (clamped). In absolute positions under a KV cache (bottom-right,
//     query position p = i + seqlen_k - seqlen_q) that is transformers' sliding_window_overlay,
//     kv > p - w. A window that reaches the first key (w >= i + 1 + shift) changes nothing.
#define ATTN_EXPORT_TRAILING_ATTRIBUTES(X) \
  X(double, softcap, 0.0)                  \
  X(int64_t, causal_alignment, 0)          \
  X(int64_t, window, 0)

// The list expanded into members with their defaults (AttentionParams, ops/core_args.h's CoreOptions).
#define ATTN_EXPORT_ATTRIBUTE_FIELD(type, name, default_value) type name = default_value;

// The params' small accessors run in CUDA kernels too.
#if defined(__CUDACC__)
#define ATTN_EXPORT_HOST_DEVICE __host__ __device__
#else
#define ATTN_EXPORT_HOST_DEVICE
#endif

namespace attn_export {

// The values of causal_alignment.
inline constexpr int64_t kCausalTopLeft = 0;
inline constexpr int64_t kCausalBottomRight = 1;

enum class DataType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

enum class MaskKind : int32_t {
  kNone = 0,
  kBool = 1,      // one byte per element, nonzero = masked out
  kAdditive = 2,  // added to the scaled scores; dtype given by the mask's DataType field
};

struct AttentionMask {
  const void* ptr = nullptr;
  MaskKind kind = MaskKind::kNone;
  DataType dtype = DataType::kFloat32;  // only meaningful for kAdditive
  int64_t batch_stride = 0;
  int64_t head_stride = 0;  // unused by the key-padding mask
  int64_t row_stride = 0;   // unused by the key-padding mask
  int64_t col_stride = 0;

  bool present() const { return kind != MaskKind::kNone && ptr != nullptr; }
};

struct AttentionParams {
  int64_t batch = 0;
  int64_t num_heads = 0;
  int64_t num_heads_k = 0;  // of k and v; divides num_heads. 0 (a binding that predates it) = num_heads
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;
  DataType dtype = DataType::kFloat32;  // of q, k, v and out

  const void* q = nullptr;
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  const void* k = nullptr;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  const void* v = nullptr;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  void* out = nullptr;
  int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0;

  void* lse = nullptr;      // [batch, num_heads, seqlen_q], contiguous
  void* weights = nullptr;  // [batch, num_heads, seqlen_q, seqlen_k], contiguous; nullptr = not needed

  AttentionMask attn_mask;
  AttentionMask key_padding_mask;

  double scale = 1.0;  // multiplies q.k before the masks are added
  bool is_causal = false;
  // Set by the CUDA dispatch only (never by a binding): the flash kernels skip the key tiles the
  // key-padding mask pads entirely (kernels/cuda/key_tile_range.cuh).
  bool skip_padded_key_tiles = false;
  ATTN_EXPORT_TRAILING_ATTRIBUTES(ATTN_EXPORT_ATTRIBUTE_FIELD)  // softcap, causal_alignment, window
  // [num_heads] float32 ALiBi slopes, in the kernels' memory; nullptr = off (no bias at all). Not
  // a trailing attribute: the operators take a list (core_args.h's ATTN_EXPORT_TRAILING_ARGUMENTS)
  // and the binding keeps the float32 copy this points at alive.
  const float* alibi_slopes = nullptr;

  // ALiBi's distance of query i from key j (alibi_bias = -slope * distance): j's offset from row
  // i's bottom-right diagonal i + seqlen_k - seqlen_q, whatever causal_alignment is.
  ATTN_EXPORT_HOST_DEVICE int64_t alibi_diagonal(int64_t i) const { return i + seqlen_k - seqlen_q; }

  // The key/value head query head h reads.
  ATTN_EXPORT_HOST_DEVICE int64_t kv_head(int64_t h) const {
    return num_heads_k > 0 && num_heads_k != num_heads ? h / (num_heads / num_heads_k) : h;
  }
  // Under is_causal, query i sees keys j <= i + causal_shift().
  ATTN_EXPORT_HOST_DEVICE int64_t causal_shift() const {
    return causal_alignment == kCausalBottomRight ? seqlen_k - seqlen_q : 0;
  }
  // Under is_causal, query i sees keys [0, causal_key_end(i)) (clamped to [0, seqlen_k]).
  ATTN_EXPORT_HOST_DEVICE int64_t causal_key_end(int64_t i) const {
    const int64_t end = i + 1 + causal_shift();
    return end < 0 ? 0 : (end > seqlen_k ? seqlen_k : end);
  }
  // Under is_causal, query i sees keys [causal_key_begin(i), causal_key_end(i)): 0 without a
  // window, else the first of the last `window` keys up to the diagonal (clamped to [0, seqlen_k]).
  ATTN_EXPORT_HOST_DEVICE int64_t causal_key_begin(int64_t i) const {
    if (window <= 0) {
      return 0;
    }
    const int64_t begin = i + 1 + causal_shift() - window;
    return begin < 0 ? 0 : (begin > seqlen_k ? seqlen_k : begin);
  }
};

// The backward pass reads everything the forward read (it recomputes the probabilities from
// q, k and lse instead of storing the seqlen_q x seqlen_k matrix) plus the incoming gradients.
// `out` (inherited) holds the forward's output: the CUDA kernels read it for the row term
// rowsum(dO * O) of the softmax backward; the CPU kernel, which sees whole rows, ignores it.
struct AttentionBackwardParams : AttentionParams {
  const void* grad_out = nullptr;  // like out
  int64_t grad_out_batch_stride = 0, grad_out_head_stride = 0, grad_out_row_stride = 0;
  // Optional gradient of the returned attention weights, broadcast to
  // [batch, num_heads, seqlen_q, seqlen_k] (strides may be 0), accumulation type, last dim contiguous.
  const void* grad_weights = nullptr;
  int64_t grad_weights_batch_stride = 0, grad_weights_head_stride = 0, grad_weights_row_stride = 0;
  void* grad_q = nullptr;  // like q
  int64_t grad_q_batch_stride = 0, grad_q_head_stride = 0, grad_q_row_stride = 0;
  // grad_k and grad_v are per QUERY head, [batch, num_heads, seqlen_k, ...]: the kernels write the
  // gradient of query head h's use of k/v at head h; the binding sums each group into dK/dV (so
  // that no two kernel tasks write one element, and no kernel needs a second pass).
  void* grad_k = nullptr;  // like k, num_heads heads
  int64_t grad_k_batch_stride = 0, grad_k_head_stride = 0, grad_k_row_stride = 0;
  void* grad_v = nullptr;  // like v, num_heads heads
  int64_t grad_v_batch_stride = 0, grad_v_head_stride = 0, grad_v_row_stride = 0;
  // Reproducible gradients, bit for bit (torch.use_deterministic_algorithms): the kernels that
  // accumulate dQ with atomics take their turns in a fixed order instead. Only the Hopper backward
  // reads it (the sm80 flash backward's atomics are unordered; docs/cuda.md "Hopper backward").
  bool deterministic = false;
};

}  // namespace attn_export
