// Typed handles to the attention core's operators, so C++ callers (the layer op, autograd)
// go through the dispatcher and reach whichever device kernel the tensors need.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>

namespace attn_export::ops {

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_forward(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale,
    bool need_weights) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attn_export::_attention_forward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           bool, std::optional<double>, bool)>();
  return op.call(query, key, value, attn_mask, key_padding_mask, is_causal, scale, need_weights);
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
    const std::optional<at::Tensor>& probs = std::nullopt,
    const std::optional<at::Tensor>& output = std::nullopt) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attn_export::_attention_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           bool, std::optional<double>, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&)>();
  return op.call(grad_output, grad_weights, query, key, value, logsumexp, attn_mask,
                 key_padding_mask, is_causal, scale, probs, output);
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
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
    bool packed_qkv,
    bool save_probs) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attn_export::_multi_head_attention_forward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
              const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, bool, bool,
              bool, bool, bool)>();
  return op.call(query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight,
                 out_proj_bias, attn_mask, key_padding_mask, need_weights, average_attn_weights,
                 is_causal, batch_first, packed_qkv, save_probs);
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
    const at::Tensor& probs,
    std::array<bool, 7> output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("attn_export::_multi_head_attention_backward", "")
          .typed<MultiHeadAttentionGrads(
              const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, int64_t, const at::Tensor&, const std::optional<at::Tensor>&,
              const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, bool, bool, bool, bool, bool, bool, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              std::array<bool, 7>)>();
  return op.call(grad_output, grad_weights, query, key, value, num_heads, in_proj_weight,
                 in_proj_bias, out_proj_weight, out_proj_bias, attn_mask, key_padding_mask,
                 need_weights, average_attn_weights, is_causal, batch_first, packed_qkv, shared_kv,
                 q_proj, kv_proj, attn, logsumexp, probs, output_mask);
}

}  // namespace attn_export::ops
