#include "verified_inputs.h"

#include <limits>
#include <vector>

#include "attention_binding.h"

namespace attn_export::ops {
namespace {

// [B, Hkv, L, D] -> [B, H, L, D], query head h reading head h / (H / Hkv) as the kernels would.
at::Tensor expand_heads(const at::Tensor& t, int64_t heads) {
  const int64_t heads_k = t.size(1);
  if (heads_k == heads) {
    return t;
  }
  return t.unsqueeze(2).expand({t.size(0), heads_k, heads / heads_k, t.size(2), t.size(3)}).flatten(1, 2);
}

// The attention mask with the causal diagonal (shifted by `shift`) and the sliding window merged
// in: true/-inf where key j is past query i's diagonal, j > i + shift, or, when window > 0,
// before its window, j <= i + shift - window.
at::Tensor with_causal_keys(const std::optional<at::Tensor>& mask, int64_t seqlen_q, int64_t seqlen_k,
                            int64_t shift, int64_t window, at::Device device) {
  const auto index = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor rows = at::arange(seqlen_q, index).unsqueeze(1);
  const at::Tensor cols = at::arange(seqlen_k, index).unsqueeze(0);
  at::Tensor hidden = cols > rows + shift;  // [Lq, Lk]
  if (window > 0) {
    hidden = at::logical_or(hidden, cols <= rows + (shift - window));
  }
  if (!mask.has_value() || !mask->defined()) {
    return hidden;
  }
  if (mask->scalar_type() == at::kBool) {
    return at::logical_or(*mask, hidden);
  }
  return at::where(hidden, at::scalar_tensor(-std::numeric_limits<double>::infinity(), mask->options()), *mask);
}

// ALiBi's bias merged into the attention mask: -slope[h] * |i + Lk - Lq - j| as a float32 [1, H, Lq, Lk]
// (the slopes rounded to float32, as the kernels read them), -inf where a bool mask hides a key, added
// to a floating mask (in float32 or wider).
at::Tensor with_alibi_bias(const std::optional<at::Tensor>& mask, const std::vector<double>& slopes, int64_t batch,
                           int64_t seqlen_q, int64_t seqlen_k, at::Device device) {
  const int64_t heads = static_cast<int64_t>(slopes.size());
  const at::Tensor m = at::tensor(slopes, at::TensorOptions().dtype(at::kDouble)).to(at::kFloat).to(device);
  const auto index = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor rows = at::arange(seqlen_q, index).unsqueeze(1) + (seqlen_k - seqlen_q);
  const at::Tensor cols = at::arange(seqlen_k, index).unsqueeze(0);
  const at::Tensor distance = (rows - cols).abs().to(at::kFloat);  // [Lq, Lk]
  const at::Tensor bias = -(m.view({1, heads, 1, 1}) * distance);   // [1, H, Lq, Lk]
  if (!mask.has_value() || !mask->defined()) {
    return bias;
  }
  const at::Tensor m4 = broadcast_attn_mask(*mask, batch, heads, seqlen_q, seqlen_k);
  if (m4.scalar_type() == at::kBool) {
    return at::where(m4, at::scalar_tensor(-std::numeric_limits<double>::infinity(), bias.options()), bias);
  }
  return m4.to(at::promote_types(m4.scalar_type(), at::kFloat)) + bias;
}

}  // namespace

KernelInputs verified_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const CoreOptions& options, bool preview) {
  check_alibi_slopes(options, query.size(1));  // before any use of them, with the caller's words
  KernelInputs inputs{key, value, options};
  if (preview) {
    return inputs;
  }
  const int64_t heads = query.size(1);
  if (key.size(1) != heads && key.size(1) > 0 && heads % key.size(1) == 0) {
    inputs.key = expand_heads(key, heads);
    inputs.value = expand_heads(value, heads);
  }
  CoreOptions& o = inputs.options;
  const int64_t seqlen_q = query.size(2), seqlen_k = key.size(2);
  if (o.is_causal && o.window > 0) {
    // The window is a preview path: the verified kernels get it as a boolean [Lq, Lk] mask.
    const int64_t shift = o.causal_alignment == kCausalBottomRight ? seqlen_k - seqlen_q : 0;
    o.attn_mask = with_causal_keys(o.attn_mask, seqlen_q, seqlen_k, shift, o.window, query.device());
    o.is_causal = false;
    o.window = 0;
    o.causal_alignment = kCausalTopLeft;
  } else if (o.is_causal && o.causal_alignment == kCausalBottomRight) {
    if (seqlen_q == 1 && seqlen_k >= 1) {
      o.is_causal = false;  // the one query row sees keys j <= Lk - 1: all of them
    } else if (seqlen_q != seqlen_k) {
      o.attn_mask = with_causal_keys(o.attn_mask, seqlen_q, seqlen_k, seqlen_k - seqlen_q, 0, query.device());
      o.is_causal = false;
    }
    o.causal_alignment = kCausalTopLeft;
  }
  if (o.has_alibi()) {
    // ALiBi in the kernels is a preview path: the verified kernels get the bias as a floating mask
    // (H x Lq x Lk float32 more memory; the distance is the bottom-right one whatever the alignment).
    o.attn_mask = with_alibi_bias(o.attn_mask, *o.alibi_slopes, query.size(0), seqlen_q, seqlen_k, query.device());
    o.alibi_slopes = std::nullopt;
  }
  return inputs;
}

ForwardArgs verified_forward_args(const ForwardArgs& a, bool preview) {
  check_attention_inputs(a.query, a.key, a.value, a.options.attn_mask, a.options.key_padding_mask);
  check_core_attributes(a.options);
  KernelInputs inputs = verified_inputs(a.query, a.key, a.value, a.options, preview);
  return ForwardArgs{a.query, std::move(inputs.key), std::move(inputs.value), std::move(inputs.options), a.need_weights};
}

}  // namespace attn_export::ops
