// The whole torch.nn.MultiheadAttention layer: input projection, attention core, output
// projection.
//
// Two implementations share the declarations below:
//  - a device-generic one (multi_head_attention.cpp): projections through ATen (BLAS /
//    cuBLAS) and the core through the dispatcher, written with SymInts so that AOTAutograd
//    can trace it with symbolic shapes; it serves CUDA and the backward pass;
//  - a CPU one (cpu/multi_head_attention_cpu_binding.cpp) that calls the CPU attention
//    kernels directly on the projection buffers, without views or dispatch, for small inputs.
//
// Each backend registers the one it uses in its own folder: cpu/multi_head_attention_cpu_binding.cpp
// the CPU one, cuda/multi_head_attention_cuda_binding.cpp the device-generic one.
//
// Token order: the projections work on token-major 2-D views [tokens, E] of the inputs, in
// the inputs' own order ([L * B] rows for sequence-first, [B * L] for batch-first; unbatched
// [L, E] counts as batch-first with B = 1), so no input is ever transposed.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>

namespace attn_export::ops {

struct MultiHeadAttentionArgs {
  const at::Tensor& query;
  const at::Tensor& key;
  const at::Tensor& value;
  int64_t num_heads;
  const at::Tensor& in_proj_weight;
  const std::optional<at::Tensor>& in_proj_bias;
  const at::Tensor& out_proj_weight;
  const std::optional<at::Tensor>& out_proj_bias;
  const std::optional<at::Tensor>& attn_mask;
  const std::optional<at::Tensor>& key_padding_mask;
  bool need_weights;
  bool average_attn_weights;
  bool is_causal;
  bool batch_first;
};

// The forward's results, with what the backward needs (attn_export::_multi_head_attention_forward).
struct MultiHeadAttentionResult {
  at::Tensor output;   // the query's shape
  at::Tensor weights;  // [B, Lq, Lk] / [B, H, Lq, Lk] (unbatched: no B), or empty
  at::Tensor q_proj;   // packed: [Nq, 3E] (q|k|v); else [Nq, E]. Token order of the query.
  at::Tensor kv_proj;  // packed: empty; else [Nk, 2E] (k|v). Token order of the key.
  at::Tensor attn;     // [Nq, E] attention output before the output projection
  at::Tensor lse;      // [B, H, Lq] row log-sum-exp, accumulation dtype
};

void check_multi_head_attention_inputs(const MultiHeadAttentionArgs& args, bool packed_qkv);

// packed_qkv: query, key and value are one tensor, projected by one GEMM.
MultiHeadAttentionResult multi_head_attention_forward(const MultiHeadAttentionArgs& args, bool packed_qkv);
MultiHeadAttentionResult multi_head_attention_forward_cpu(const MultiHeadAttentionArgs& args, bool packed_qkv);

// x W^T + b on token-major rows.
inline at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
}

// a @ b for 2-D tensors; on the CPU through the GEMM backend in force (cpu/projection.cpp,
// csrc/kernels/cpu/gemm_backend.h), elsewhere at::mm.
at::Tensor backend_mm(const at::Tensor& a, const at::Tensor& b);

inline std::optional<at::Tensor> bias_rows(const std::optional<at::Tensor>& bias, int64_t start, int64_t length) {
  if (!bias.has_value()) {
    return std::nullopt;
  }
  return bias->narrow(0, start, length);
}

// The key padding mask as the core expects it: [B, Lk] (an unbatched [Lk] gains B = 1).
std::optional<at::Tensor> batched_padding_mask(const MultiHeadAttentionArgs& args);

// Head-averaging and unbatching of the core's [B, H, Lq, Lk] probabilities, as
// nn.MultiheadAttention returns them.
at::Tensor finalize_weights(const at::Tensor& weights, const MultiHeadAttentionArgs& args);

// Gradients of the input projections' outputs, shaped like MultiHeadAttentionResult's
// q_proj and kv_proj (kv_proj empty when packed).
struct ProjectionGrads {
  at::Tensor q_proj, kv_proj;
};

// The attention core's part of the backward: from the gradient of the attention output
// (grad_attn, [Nq, E] token order) and of the per-head probabilities (optional, broadcastable
// to [B, H, Lq, Lk]) to the gradients of the projections. One implementation per device.
using CoreBackwardFn = ProjectionGrads (*)(
    const MultiHeadAttentionArgs& args,
    bool packed_qkv,
    const MultiHeadAttentionResult& saved,
    const at::Tensor& grad_attn,
    const std::optional<at::Tensor>& grad_probs);

ProjectionGrads core_backward(const MultiHeadAttentionArgs&, bool, const MultiHeadAttentionResult&,
                              const at::Tensor&, const std::optional<at::Tensor>&);
ProjectionGrads core_backward_cpu(const MultiHeadAttentionArgs&, bool, const MultiHeadAttentionResult&,
                                  const at::Tensor&, const std::optional<at::Tensor>&);

// Gradients for (query, key, value, in_proj_weight, in_proj_bias, out_proj_weight,
// out_proj_bias); an entry is undefined where `needs` is false or where the gradient flows
// through another argument that is the same tensor (packed: all of it goes to query; shared_kv:
// key and value are one tensor, all of it goes to key).
std::array<at::Tensor, 7> multi_head_attention_backward(
    const MultiHeadAttentionArgs& args,
    bool packed_qkv,
    bool shared_kv,
    const MultiHeadAttentionResult& saved,
    const at::Tensor& grad_output,
    const at::Tensor& grad_weights,
    const std::array<bool, 7>& needs,
    CoreBackwardFn core);

// The layer's operator kernels over one implementation (Forward: multi_head_attention_forward
// or multi_head_attention_forward_cpu; Core: core_backward or core_backward_cpu), for each
// backend's TORCH_LIBRARY_IMPL (cpu/multi_head_attention_cpu_binding.cpp,
// cuda/multi_head_attention_cuda_binding.cpp).
template <MultiHeadAttentionResult (*Forward)(const MultiHeadAttentionArgs&, bool)>
std::tuple<at::Tensor, at::Tensor> layer_kernel(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
    const at::Tensor& in_proj_weight, const std::optional<at::Tensor>& in_proj_bias,
    const at::Tensor& out_proj_weight, const std::optional<at::Tensor>& out_proj_bias,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool need_weights, bool average_attn_weights, bool is_causal, bool batch_first) {
  const MultiHeadAttentionArgs args{query, key, value, num_heads, in_proj_weight, in_proj_bias,
                                    out_proj_weight, out_proj_bias, attn_mask, key_padding_mask,
                                    need_weights, average_attn_weights, is_causal, batch_first};
  const bool packed = query.is_same(key) && key.is_same(value);
  MultiHeadAttentionResult r = Forward(args, packed);
  return std::make_tuple(r.output, r.weights);
}

template <MultiHeadAttentionResult (*Forward)(const MultiHeadAttentionArgs&, bool)>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
layer_forward_kernel(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
    const at::Tensor& in_proj_weight, const std::optional<at::Tensor>& in_proj_bias,
    const at::Tensor& out_proj_weight, const std::optional<at::Tensor>& out_proj_bias,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool need_weights, bool average_attn_weights, bool is_causal, bool batch_first, bool packed_qkv) {
  const MultiHeadAttentionArgs args{query, key, value, num_heads, in_proj_weight, in_proj_bias,
                                    out_proj_weight, out_proj_bias, attn_mask, key_padding_mask,
                                    need_weights, average_attn_weights, is_causal, batch_first};
  MultiHeadAttentionResult r = Forward(args, packed_qkv);
  return std::make_tuple(r.output, r.weights, r.q_proj, r.kv_proj, r.attn, r.lse);
}

using MultiHeadAttentionGrads =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// attn_export::_multi_head_attention_backward's arguments beyond the layer's own.
struct LayerBackwardArgs {
  const at::Tensor& grad_output;
  const std::optional<at::Tensor>& grad_weights;
  bool packed_qkv;
  bool shared_kv;
  const MultiHeadAttentionResult& saved;  // q_proj, kv_proj, attn, lse
  std::array<bool, 7> output_mask;
};

using LayerBackwardImpl = MultiHeadAttentionGrads (*)(const MultiHeadAttentionArgs&, const LayerBackwardArgs&);

// The backward operator's kernel over one implementation (device_layer_backward, or autograd's).
template <LayerBackwardImpl Impl>
MultiHeadAttentionGrads layer_backward_op(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t num_heads,
    const at::Tensor& in_proj_weight, const std::optional<at::Tensor>& in_proj_bias,
    const at::Tensor& out_proj_weight, const std::optional<at::Tensor>& out_proj_bias,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool need_weights, bool average_attn_weights, bool is_causal, bool batch_first, bool packed_qkv,
    bool shared_kv, const at::Tensor& q_proj, const at::Tensor& kv_proj, const at::Tensor& attn,
    const at::Tensor& logsumexp, std::array<bool, 7> output_mask) {
  const MultiHeadAttentionArgs args{query, key, value, num_heads, in_proj_weight, in_proj_bias,
                                    out_proj_weight, out_proj_bias, attn_mask, key_padding_mask,
                                    need_weights, average_attn_weights, is_causal, batch_first};
  MultiHeadAttentionResult saved;
  saved.q_proj = q_proj;
  saved.kv_proj = kv_proj;
  saved.attn = attn;
  saved.lse = logsumexp;
  return Impl(args, {grad_output, grad_weights, packed_qkv, shared_kv, saved, output_mask});
}

// A device's backward (Core: core_backward or core_backward_cpu). Undefined gradients (not
// needed, or flowing through another argument) travel as empty tensors.
template <CoreBackwardFn Core>
MultiHeadAttentionGrads device_layer_backward(const MultiHeadAttentionArgs& args, const LayerBackwardArgs& b) {
  auto g = multi_head_attention_backward(args, b.packed_qkv, b.shared_kv, b.saved, b.grad_output,
                                         b.grad_weights.value_or(at::Tensor()), b.output_mask, Core);
  for (at::Tensor& t : g) {
    if (!t.defined()) {
      t = at::empty({0}, b.grad_output.options());
    }
  }
  return std::make_tuple(g[0], g[1], g[2], g[3], g[4], g[5], g[6]);
}

}  // namespace attn_export::ops
