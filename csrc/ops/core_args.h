// The attention core's arguments, said once. Every implementation of the core operators (CPU,
// CUDA, the CUDA emulator's test ops) takes one of these structs, and the operators' flat
// signatures (the schemas of attention.cpp, as TORCH_LIBRARY needs them) are spelled only in
// the adapters below and in dispatch.h (docs/architecture.md lists what a new attribute touches).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <optional>
#include <tuple>

namespace attn_export::ops {

// Everything of the core besides its tensors: masks, causality, scale, soft-cap.
struct CoreOptions {
  std::optional<at::Tensor> attn_mask;
  std::optional<at::Tensor> key_padding_mask;
  bool is_causal = false;
  std::optional<double> scale;  // default 1/sqrt(head_dim)
  double softcap = 0.0;         // 0 = off

  // The non-tensor options as one value (what autograd keeps for the backward) and back.
  c10::IValue scalars() const { return c10::ivalue::Tuple::create({is_causal, scale, softcap}); }
  static CoreOptions from(std::optional<at::Tensor> attn_mask, std::optional<at::Tensor> key_padding_mask,
                          const c10::IValue& scalars) {
    const auto& s = scalars.toTupleRef().elements();
    return {std::move(attn_mask), std::move(key_padding_mask), s[0].toBool(), s[1].toOptional<double>(),
            s[2].toDouble()};
  }
};

// attn_export::_attention_forward: q, k, v [B, H, L, D].
struct ForwardArgs {
  at::Tensor query, key, value;
  CoreOptions options;
  bool need_weights = false;
};

// attn_export::_attention_backward: the output's gradient (and the weights', when returned),
// the forward's inputs, its log-sum-exp and, when kept, its output (the flash backwards read
// rowsum(dO * O) from it).
struct BackwardArgs {
  at::Tensor grad_output;
  std::optional<at::Tensor> grad_weights;
  at::Tensor query, key, value, logsumexp;
  std::optional<at::Tensor> output;
  CoreOptions options;
};

using ForwardResults = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // output, logsumexp, weights
using CoreGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor>;       // dq, dk, dv

using ForwardImpl = ForwardResults (*)(const ForwardArgs&);
using BackwardImpl = CoreGrads (*)(const BackwardArgs&);

// The operators' kernels over one implementation, for each backend's TORCH_LIBRARY_IMPL:
//   m.impl(spec::kOpAttention, &attention_kernel<attention_forward_cpu>);
template <ForwardImpl Impl>
at::Tensor attention_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& attn_mask,
                            const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                            std::optional<double> scale, double softcap) {
  return std::get<0>(Impl({query, key, value, {attn_mask, key_padding_mask, is_causal, scale, softcap}, false}));
}

template <ForwardImpl Impl>
ForwardResults attention_forward_kernel(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask,
                                        const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                        std::optional<double> scale, bool need_weights, double softcap) {
  return Impl({query, key, value, {attn_mask, key_padding_mask, is_causal, scale, softcap}, need_weights});
}

template <BackwardImpl Impl>
CoreGrads attention_backward_kernel(const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights,
                                    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& logsumexp, const std::optional<at::Tensor>& attn_mask,
                                    const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                    std::optional<double> scale, const std::optional<at::Tensor>& output,
                                    double softcap) {
  return Impl({grad_output, grad_weights, query, key, value, logsumexp, output,
               {attn_mask, key_padding_mask, is_causal, scale, softcap}});
}

}  // namespace attn_export::ops
