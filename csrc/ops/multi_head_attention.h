// The whole torch.nn.MultiheadAttention layer: projections through ATen (BLAS / cuBLAS on the
// tensors' device) and the attention core through the dispatcher, so the same code serves
// every device that registers attn_export::_attention_forward/_attention_backward.
// Written with SymInts so that AOTAutograd can trace it with symbolic shapes.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace attn_export::ops {

// What the backward needs from the forward.
struct MultiHeadAttentionSaved {
  at::Tensor query2d, key2d, value2d;  // token-major [tokens, embed] inputs
  at::Tensor q, k, v;                  // [B, H, L, D] views of the projections
  at::Tensor attn;                     // [B, H, Lq, D] attention output, token-major memory
  at::Tensor lse;                      // [B, H, Lq]
  std::optional<at::Tensor> attn_mask, key_padding_mask;  // as passed to the core
  bool self_attention = false;  // query, key and value are one tensor: one packed projection
  bool shared_kv = false;       // key and value are one tensor: one packed K|V projection
  bool unbatched = false;
};

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

void check_multi_head_attention_inputs(const MultiHeadAttentionArgs& args);

// Returns (output, weights); weights is empty unless args.need_weights. Fills `saved` when given.
std::tuple<at::Tensor, at::Tensor> multi_head_attention_forward(
    const MultiHeadAttentionArgs& args, MultiHeadAttentionSaved* saved);

// Gradients for (query, key, value, in_proj_weight, in_proj_bias, out_proj_weight,
// out_proj_bias); an entry is undefined where `needs` is false or where the gradient flows
// through another argument that is the same tensor (self-attention: all of it goes to query).
std::array<at::Tensor, 7> multi_head_attention_backward(
    const MultiHeadAttentionArgs& args,
    const MultiHeadAttentionSaved& saved,
    const at::Tensor& grad_output,
    const at::Tensor& grad_weights,
    const std::array<bool, 7>& needs);

}  // namespace attn_export::ops
