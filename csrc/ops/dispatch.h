// Typed handles to the operators, so C++ callers (the layer op, autograd) go through the
// dispatcher and reach whichever device kernel the tensors need. Each call_* function has the
// operator's signature, so its handle is typed by the function's own type.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>

#include "../attention_spec.h"

namespace attn_export::ops {

// The operator `name` (a spec::kOp* name) as a handle typed by the function type Fn.
template <typename Fn>
c10::TypedOperatorHandle<Fn> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale,
    bool need_weights,
    double softcap = 0.0) {
  static auto op = typed_op<decltype(call_attention_forward)>(spec::kOpAttentionForward);
  return op.call(query, key, value, attn_mask, key_padding_mask, is_causal, scale, need_weights, softcap);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_backward(
    const at::Tensor& grad_output,
    const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale,
    const std::optional<at::Tensor>& output = std::nullopt,
    double softcap = 0.0) {
  static auto op = typed_op<decltype(call_attention_backward)>(spec::kOpAttentionBackward);
  return op.call(grad_output, grad_weights, query, key, value, logsumexp, attn_mask,
                 key_padding_mask, is_causal, scale, output, softcap);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
call_multi_head_attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    int64_t num_heads,
    const at::Tensor& in_proj_weight,
    const std::optional<at::Tensor>& in_proj_bias,
    const at::Tensor& out_proj_weight,
    const std::optional<at::Tensor>& out_proj_bias,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool need_weights,
    bool average_attn_weights,
    bool is_causal,
    bool batch_first,
    bool packed_qkv) {
  static auto op = typed_op<decltype(call_multi_head_attention_forward)>(spec::kOpMultiHeadAttentionForward);
  return op.call(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight,
                 out_proj_bias, attn_mask, key_padding_mask, need_weights, average_attn_weights,
                 is_causal, batch_first, packed_qkv);
}

using MultiHeadAttentionGrads =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

inline MultiHeadAttentionGrads call_multi_head_attention_backward(
    const at::Tensor& grad_output,
    const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    int64_t num_heads,
    const at::Tensor& in_proj_weight,
    const std::optional<at::Tensor>& in_proj_bias,
    const at::Tensor& out_proj_weight,
    const std::optional<at::Tensor>& out_proj_bias,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool need_weights,
    bool average_attn_weights,
    bool is_causal,
    bool batch_first,
    bool packed_qkv,
    bool shared_kv,
    const at::Tensor& q_proj,
    const at::Tensor& kv_proj,
    const at::Tensor& attn,
    const at::Tensor& logsumexp,
    std::array<bool, 7> output_mask) {
  static auto op = typed_op<decltype(call_multi_head_attention_backward)>(spec::kOpMultiHeadAttentionBackward);
  return op.call(grad_output, grad_weights, query, key, value, num_heads, in_proj_weight,
                 in_proj_bias, out_proj_weight, out_proj_bias, attn_mask, key_padding_mask,
                 need_weights, average_attn_weights, is_causal, batch_first, packed_qkv, shared_kv,
                 q_proj, kv_proj, attn, logsumexp, output_mask);
}

}  // namespace attn_export::ops
