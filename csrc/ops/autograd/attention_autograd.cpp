// Autograd for the attn_export operators: hand-written backward passes, registered at the
// Autograd key so that autograd never traces through the kernels' internals.
//
// When no gradient is needed (grad mode off, or no input requires grad) the kernels below
// redispatch straight to the operator under the Autograd key. This matters beyond speed:
// torch.export's run_decompositions() traces under no_grad through this kernel, and only
// the redispatch keeps the operator as one node in the exported graph.
#include <torch/autograd.h>
#include <torch/library.h>

#include "../dispatch.h"
#include "../multi_head_attention.h"

namespace attn_export::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

bool any_requires_grad(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && t->requires_grad()) {
      return true;
    }
  }
  return false;
}

bool needs_autograd(std::initializer_list<const at::Tensor*> tensors) {
  return at::GradMode::is_enabled() && any_requires_grad(tensors);
}

void check_masks_are_constant(const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& key_padding_mask) {
  TORCH_CHECK(
      !(attn_mask.has_value() && attn_mask->requires_grad()) &&
          !(key_padding_mask.has_value() && key_padding_mask->requires_grad()),
      "attn_export: gradients with respect to attn_mask / key_padding_mask are not supported; "
      "pass a mask that does not require grad (e.g. mask.detach())");
}

std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The core's autograd. q, k and v are its differentiable inputs; the options ride along as one
// argument (masks never carry a gradient: check_masks_are_constant).
class AttentionFunction : public Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const CoreOptions& options) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, weights] = call_attention_forward({query, key, value, options, /*need_weights=*/false});
    // The output is saved through save_for_backward (not saved_data, which would hold it in a
    // reference cycle with its own grad_fn): the CUDA backward needs it.
    ctx->save_for_backward({query, key, value, options.attn_mask.value_or(at::Tensor()),
                            options.key_padding_mask.value_or(at::Tensor()), out});
    ctx->saved_data["lse"] = lse;
    ctx->saved_data["options"] = options.scalars();
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const CoreOptions options = CoreOptions::from(optional_of(saved[3]), optional_of(saved[4]),
                                                  ctx->saved_data["options"]);
    auto [grad_q, grad_k, grad_v] = call_attention_backward(
        {grad_outputs[0], std::nullopt, saved[0], saved[1], saved[2], ctx->saved_data["lse"].toTensor(), saved[5],
         options});
    return {grad_q, grad_k, grad_v, at::Tensor()};
  }
};

ForwardResults attention_autograd(const ForwardArgs& a) {
  check_masks_are_constant(a.options.attn_mask, a.options.key_padding_mask);
  if (!needs_autograd({&a.query, &a.key, &a.value})) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return {call_attention(a), at::Tensor(), at::Tensor()};
  }
  return {AttentionFunction::apply(a.query, a.key, a.value, a.options)[0], at::Tensor(), at::Tensor()};
}

// The layer's non-tensor arguments, packed into one integer for saved_data.
struct LayerConfig {
  int64_t num_heads;
  bool packed_qkv, shared_kv, need_weights, average_attn_weights, is_causal, batch_first;

  int64_t pack() const {
    return num_heads << 6 | int64_t{packed_qkv} | int64_t{shared_kv} << 1 | int64_t{need_weights} << 2 |
        int64_t{average_attn_weights} << 3 | int64_t{is_causal} << 4 | int64_t{batch_first} << 5;
  }
  static LayerConfig unpack(int64_t v) {
    return {v >> 6, bool(v & 1), bool(v >> 1 & 1), bool(v >> 2 & 1), bool(v >> 3 & 1),
            bool(v >> 4 & 1), bool(v >> 5 & 1)};
  }
};

class MultiHeadAttentionFunction : public Function<MultiHeadAttentionFunction> {
 public:
  static variable_list forward(
      AutogradContext* ctx,
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
      bool batch_first) {
    check_masks_are_constant(attn_mask, key_padding_mask);
    // One tensor passed as query, key and value (self-attention) is projected by one GEMM,
    // and its gradient computed once; likewise key and value (encoder-decoder attention).
    const bool packed_qkv = query.is_same(key) && key.is_same(value);
    const bool shared_kv = !packed_qkv && key.is_same(value);
    // No saved probabilities: the backward recomputes them from the log-sum-exp, which beat
    // writing and rereading the [B, H, Lq, Lk] matrix at every shape measured, and memory stays O(L).
    at::AutoDispatchBelowADInplaceOrView guard;
    const MultiHeadAttentionArgs args{query, key, value, num_heads, in_proj_weight, in_proj_bias,
                                      out_proj_weight, out_proj_bias, attn_mask, key_padding_mask,
                                      need_weights, average_attn_weights, is_causal, batch_first};
    auto [output, weights, q_proj, kv_proj, attn, lse] = call_multi_head_attention_forward(args, packed_qkv);

    ctx->save_for_backward(
        {query, key, value, in_proj_weight, in_proj_bias.value_or(at::Tensor()), out_proj_weight,
         out_proj_bias.value_or(at::Tensor()), attn_mask.value_or(at::Tensor()),
         key_padding_mask.value_or(at::Tensor())});
    // Intermediates only this function sees, so they need no version-counter protection. Two
    // entries rather than a dozen: on small inputs every map insertion shows.
    ctx->saved_data["intermediates"] = std::vector<at::Tensor>{q_proj, kv_proj, attn, lse};
    ctx->saved_data["config"] = LayerConfig{num_heads, packed_qkv, shared_kv, need_weights,
                                            average_attn_weights, is_causal, batch_first}
                                    .pack();
    if (!need_weights) {
      ctx->mark_non_differentiable({weights});
    }
    return {output, weights};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const LayerConfig c = LayerConfig::unpack(ctx->saved_data["config"].toInt());
    const auto intermediates = ctx->saved_data["intermediates"].toTensorVector();
    const std::optional<at::Tensor> in_proj_bias = optional_of(saved[4]);
    const std::optional<at::Tensor> out_proj_bias = optional_of(saved[6]);
    const std::optional<at::Tensor> attn_mask = optional_of(saved[7]);
    const std::optional<at::Tensor> key_padding_mask = optional_of(saved[8]);
    // needs_input_grad counts only the tensor arguments that were present in the forward.
    size_t edge = 0;
    auto next_needs = [&](bool present) { return present && ctx->needs_input_grad(edge++); };
    std::array<bool, 7> needs;
    needs[0] = next_needs(true);                       // query
    needs[1] = next_needs(true);                       // key
    needs[2] = next_needs(true);                       // value
    needs[3] = next_needs(true);                       // in_proj_weight
    needs[4] = next_needs(in_proj_bias.has_value());   // in_proj_bias
    needs[5] = next_needs(true);                       // out_proj_weight
    needs[6] = next_needs(out_proj_bias.has_value());  // out_proj_bias
    // The output has the query's shape; it gets no gradient when only the weights are used.
    const at::Tensor grad_output = grad_outputs[0].defined() ? grad_outputs[0] : at::zeros_like(saved[0]);
    const std::optional<at::Tensor> grad_weights = optional_of(grad_outputs[1]);
    MultiHeadAttentionResult kept;
    kept.q_proj = intermediates[0];
    kept.kv_proj = intermediates[1];
    kept.attn = intermediates[2];
    kept.lse = intermediates[3];
    const MultiHeadAttentionArgs args{saved[0], saved[1], saved[2], c.num_heads, saved[3], in_proj_bias,
                                      saved[5], out_proj_bias, attn_mask, key_padding_mask, c.need_weights,
                                      c.average_attn_weights, c.is_causal, c.batch_first};
    const auto grads = call_multi_head_attention_backward(
        args, {grad_output, grad_weights, c.packed_qkv, c.shared_kv, kept, needs});
    // The operator returns empty tensors for gradients it does not compute (see its schema).
    const std::array<bool, 7> computed = {
        needs[0], needs[1] && !c.packed_qkv, needs[2] && !c.packed_qkv && !c.shared_kv, needs[3],
        needs[4], needs[5], needs[6]};
    std::array<at::Tensor, 7> g = {std::get<0>(grads), std::get<1>(grads), std::get<2>(grads),
                                   std::get<3>(grads), std::get<4>(grads), std::get<5>(grads),
                                   std::get<6>(grads)};
    for (size_t i = 0; i < g.size(); ++i) {
      if (!computed[i]) {
        g[i] = at::Tensor();
      }
    }
    return {g[0], g[1], g[2], at::Tensor(), g[3], g[4], g[5], g[6],
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

MultiHeadAttentionResult multi_head_attention_autograd(const MultiHeadAttentionArgs& a, bool /*packed_qkv*/) {
  const at::Tensor none;
  const at::Tensor& in_bias = a.in_proj_bias.has_value() ? *a.in_proj_bias : none;
  const at::Tensor& out_bias = a.out_proj_bias.has_value() ? *a.out_proj_bias : none;
  MultiHeadAttentionResult r;
  if (!needs_autograd({&a.query, &a.key, &a.value, &a.in_proj_weight, &in_bias, &a.out_proj_weight, &out_bias})) {
    check_masks_are_constant(a.attn_mask, a.key_padding_mask);
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(r.output, r.weights) = call_multi_head_attention(a);
    return r;
  }
  const auto outputs = MultiHeadAttentionFunction::apply(
      a.query, a.key, a.value, a.num_heads, a.in_proj_weight, a.in_proj_bias, a.out_proj_weight, a.out_proj_bias,
      a.attn_mask, a.key_padding_mask, a.need_weights, a.average_attn_weights, a.is_causal, a.batch_first);
  r.output = outputs[0];
  r.weights = outputs[1];
  return r;
}

// The kernels of the internal operators have no derivative of their own: a second-order
// gradient through attention is not supported, and says so instead of returning zeros.
// The tensors come twice: as arguments, so that autograd sees them and a second derivative
// reaches backward() and its message, and in the struct the operator is called with.
class AttentionForwardNoGrad : public Function<AttentionForwardNoGrad> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const ForwardArgs& a) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, lse, weights] = call_attention_forward(a);
    return {out, lse, weights};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, spec::kOpAttentionForward, " is an internal kernel without a derivative; call ",
                spec::kOpAttention, " (or the FusedMultiheadAttention module) for gradients");
  }
};

class AttentionBackwardNoGrad : public Function<AttentionBackwardNoGrad> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const BackwardArgs& a) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [dq, dk, dv] = call_attention_backward(a);
    return {dq, dk, dv};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, "attn_export: double backward through attention is not supported");
  }
};

class MultiHeadAttentionForwardNoGrad : public Function<MultiHeadAttentionForwardNoGrad> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const MultiHeadAttentionArgs& a,
                               bool packed_qkv) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [output, weights, q_proj, kv_proj, attn, lse] = call_multi_head_attention_forward(a, packed_qkv);
    return {output, weights, q_proj, kv_proj, attn, lse};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, spec::kOpMultiHeadAttentionForward, " is an internal kernel without a derivative; call ",
                spec::kOpMultiHeadAttention, " for gradients");
  }
};

MultiHeadAttentionResult multi_head_attention_forward_nograd(const MultiHeadAttentionArgs& a, bool packed_qkv) {
  const auto r = MultiHeadAttentionForwardNoGrad::apply(a.query, a.key, a.value, a.in_proj_weight,
                                                        a.out_proj_weight, a, packed_qkv);
  MultiHeadAttentionResult result;
  result.output = r[0];
  result.weights = r[1];
  result.q_proj = r[2];
  result.kv_proj = r[3];
  result.attn = r[4];
  result.lse = r[5];
  return result;
}

class MultiHeadAttentionBackwardNoGrad : public Function<MultiHeadAttentionBackwardNoGrad> {
 public:
  static variable_list forward(AutogradContext*, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const MultiHeadAttentionArgs& a, const LayerBackwardArgs& b) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const auto g = call_multi_head_attention_backward(a, b);
    return {std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g), std::get<4>(g),
            std::get<5>(g), std::get<6>(g)};
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false, "attn_export: double backward through multi_head_attention is not supported");
  }
};

MultiHeadAttentionGrads multi_head_attention_backward_nograd(const MultiHeadAttentionArgs& a,
                                                             const LayerBackwardArgs& b) {
  const auto r = MultiHeadAttentionBackwardNoGrad::apply(b.grad_output, a.query, a.key, a.value,
                                                         a.in_proj_weight, a.out_proj_weight, a, b);
  return std::make_tuple(r[0], r[1], r[2], r[3], r[4], r[5], r[6]);
}

ForwardResults attention_forward_nograd(const ForwardArgs& a) {
  const auto r = AttentionForwardNoGrad::apply(a.query, a.key, a.value, a);
  return std::make_tuple(r[0], r[1], r[2]);
}

CoreGrads attention_backward_nograd(const BackwardArgs& a) {
  const auto r = AttentionBackwardNoGrad::apply(a.grad_output, a.query, a.key, a.value, a);
  return std::make_tuple(r[0], r[1], r[2]);
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_export, Autograd, m) {
  m.impl(spec::kOpAttention, &attention_kernel<attention_autograd>);
  m.impl(spec::kOpMultiHeadAttention, &layer_kernel<multi_head_attention_autograd>);
  m.impl(spec::kOpAttentionForward, &attention_forward_kernel<attention_forward_nograd>);
  m.impl(spec::kOpAttentionBackward, &attention_backward_kernel<attention_backward_nograd>);
  m.impl(spec::kOpMultiHeadAttentionForward, &layer_forward_kernel<multi_head_attention_forward_nograd>);
  m.impl(spec::kOpMultiHeadAttentionBackward, &layer_backward_op<multi_head_attention_backward_nograd>);
}

}  // namespace attn_export::ops
