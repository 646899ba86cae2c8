// Typed handles to the attention core's operators, so C++ callers (the layer op, autograd)
// go through the dispatcher and reach whichever device kernel the tensors need.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

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
    std::optional<double> scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("attn_export::_attention_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           bool, std::optional<double>)>();
  return op.call(grad_output, grad_weights, query, key, value, logsumexp, attn_mask,
                 key_padding_mask, is_causal, scale);
}

}  // namespace attn_export::ops
