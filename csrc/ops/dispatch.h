// Typed handles to the operators, so C++ callers (the layer op, autograd) go through the
// dispatcher and reach whichever device kernel the tensors need. Each call_* function has the
// operator's signature, so its handle is typed by the function's own type.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <array>
#include <optional>
#include <tuple>

#include "../attention_spec.h"
#include "core_args.h"
#include "multi_head_attention.h"

namespace attn_export::ops {

// The operator `name` (a spec::kOp* name) as a handle typed by the function type Fn.
template <typename Fn>
c10::TypedOperatorHandle<Fn> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The core's operators take their arguments as the structs of core_args.h; the handles are
// typed by the adapters' flat signatures, which match the schemas, and the calls spell the
// leading arguments and expand the trailing attributes (attention_params.h) as they do.
#define ATTN_EXPORT_OPTION_ARGUMENT(type, name, default_value) , o.name
inline std::tuple<at::Tensor, at::Tensor> call_multi_head_attention(const MultiHeadAttentionArgs& a) {
  static auto op = typed_op<decltype(layer_kernel<nullptr>)>(spec::kOpMultiHeadAttention);
  return op.call(a.query, a.key, a.value, a.num_heads, a.in_proj_weight, a.in_proj_bias, a.out_proj_weight,
                 a.out_proj_bias, a.attn_mask, a.key_padding_mask, a.need_weights, a.average_attn_weights,
                 a.is_causal, a.batch_first);
}

inline at::Tensor call_attention(const ForwardArgs& a) {
  static auto op = typed_op<decltype(attention_kernel<nullptr>)>(spec::kOpAttention);
  const CoreOptions& o = a.options;
  return op.call(a.query, a.key, a.value, o.attn_mask, o.key_padding_mask, o.is_causal,
                 o.scale ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_OPTION_ARGUMENT));
}

inline ForwardResults call_attention_forward(const ForwardArgs& a) {
  static auto op = typed_op<decltype(attention_forward_kernel<nullptr>)>(spec::kOpAttentionForward);
  const CoreOptions& o = a.options;
  return op.call(a.query, a.key, a.value, o.attn_mask, o.key_padding_mask, o.is_causal, o.scale,
                 a.need_weights ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_OPTION_ARGUMENT));
}

inline CoreGrads call_attention_backward(const BackwardArgs& a) {
  static auto op = typed_op<decltype(attention_backward_kernel<nullptr>)>(spec::kOpAttentionBackward);
  const CoreOptions& o = a.options;
  return op.call(a.grad_output, a.grad_weights, a.query, a.key, a.value, a.logsumexp, o.attn_mask,
                 o.key_padding_mask, o.is_causal, o.scale,
                 a.output ATTN_EXPORT_TRAILING_ARGUMENTS(ATTN_EXPORT_OPTION_ARGUMENT));
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
call_multi_head_attention_forward(const MultiHeadAttentionArgs& a, bool packed_qkv) {
  static auto op = typed_op<decltype(layer_forward_kernel<nullptr>)>(spec::kOpMultiHeadAttentionForward);
  return op.call(a.query, a.key, a.value, a.num_heads, a.in_proj_weight, a.in_proj_bias, a.out_proj_weight,
                 a.out_proj_bias, a.attn_mask, a.key_padding_mask, a.need_weights, a.average_attn_weights,
                 a.is_causal, a.batch_first, packed_qkv);
}

inline MultiHeadAttentionGrads call_multi_head_attention_backward(const MultiHeadAttentionArgs& a,
                                                                  const LayerBackwardArgs& b) {
  static auto op = typed_op<decltype(layer_backward_op<nullptr>)>(spec::kOpMultiHeadAttentionBackward);
  return op.call(b.grad_output, b.grad_weights, a.query, a.key, a.value, a.num_heads, a.in_proj_weight,
                 a.in_proj_bias, a.out_proj_weight, a.out_proj_bias, a.attn_mask, a.key_padding_mask,
                 a.need_weights, a.average_attn_weights, a.is_causal, a.batch_first, b.packed_qkv, b.shared_kv,
                 b.saved.q_proj, b.saved.kv_proj, b.saved.attn, b.saved.lse, b.output_mask);
}

}  // namespace attn_export::ops
