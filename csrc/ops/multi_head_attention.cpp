#include "multi_head_attention.h"

#include <torch/library.h>

#include "dispatch.h"

namespace attn_export::ops {
namespace {

using c10::SymInt;

// Internally the layer is batch-first, [B, L, E]; the projections work on its token-major
// 2-D view [B * L, E]. Sequence-first and unbatched inputs are converted at the boundary.
struct Geometry {
  SymInt batch, seqlen_q, seqlen_k, embed_dim, head_dim;
  int64_t num_heads;
};

at::Tensor to_batch_first(const at::Tensor& t, bool unbatched, bool batch_first) {
  if (unbatched) {
    return t.unsqueeze(0);
  }
  return batch_first ? t : t.transpose(0, 1);
}

at::Tensor from_batch_first(const at::Tensor& t, bool unbatched, bool batch_first) {
  if (unbatched) {
    return t.squeeze(0);
  }
  return batch_first ? t : t.transpose(0, 1);
}

at::Tensor linear2d(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
}

std::optional<at::Tensor> rows_of(const std::optional<at::Tensor>& bias, int64_t start, int64_t length) {
  if (!bias.has_value()) {
    return std::nullopt;
  }
  return bias->narrow(0, start, length);
}

// [B * L, count * E] -> the index-th [B, H, L, D] block, as a view.
at::Tensor split_heads(const at::Tensor& proj2d, int64_t index, int64_t count, const SymInt& seqlen,
                       const Geometry& g) {
  return proj2d.view_symint({g.batch, seqlen, count, g.num_heads, g.head_dim})
      .select(2, index)
      .transpose(1, 2);
}

// [B, H, L, D] -> [B * L, E]; a view for the token-major results of the attention kernels.
at::Tensor merge_heads(const at::Tensor& t, const Geometry& g) {
  return t.transpose(1, 2).reshape_symint({SymInt(-1), g.embed_dim});
}

at::Tensor tokens2d(const at::Tensor& t, const Geometry& g) {
  return t.reshape_symint({SymInt(-1), g.embed_dim});
}

// Geometry of batch-first [B, L, E] query and key.
Geometry geometry(const at::Tensor& query, const at::Tensor& key, int64_t num_heads) {
  Geometry g;
  g.num_heads = num_heads;
  g.batch = query.sym_size(0);
  g.seqlen_q = query.sym_size(1);
  g.seqlen_k = key.sym_size(1);
  g.embed_dim = query.sym_size(2);
  g.head_dim = g.embed_dim / num_heads;
  return g;
}

}  // namespace

void check_multi_head_attention_inputs(const MultiHeadAttentionArgs& a) {
  const at::Tensor& query = a.query;
  TORCH_CHECK(
      (query.dim() == 2 || query.dim() == 3) && a.key.dim() == query.dim() &&
          a.value.dim() == query.dim(),
      "multi_head_attention: query, key and value must all be 3-D (batched) or all 2-D "
      "(unbatched); got query ", query.sizes(), ", key ", a.key.sizes(), ", value ", a.value.sizes());
  TORCH_CHECK(a.num_heads > 0, "multi_head_attention: num_heads must be positive; got ", a.num_heads);
  const SymInt embed_dim = query.sym_size(-1);
  TORCH_CHECK(
      embed_dim % a.num_heads == 0,
      "multi_head_attention: embed_dim ", embed_dim, " is not divisible by num_heads ", a.num_heads);
  TORCH_CHECK(
      a.key.sym_size(-1) == embed_dim && a.value.sym_size(-1) == embed_dim,
      "multi_head_attention: key and value must have the query's embed_dim ", embed_dim,
      " (kdim/vdim are not supported); got key ", a.key.sizes(), ", value ", a.value.sizes());
  TORCH_CHECK(
      a.key.sym_sizes().slice(0, a.key.dim() - 1) == a.value.sym_sizes().slice(0, a.value.dim() - 1),
      "multi_head_attention: key and value must have the same length and batch; got key ",
      a.key.sizes(), ", value ", a.value.sizes());
  if (query.dim() == 3) {
    const int64_t batch_dim = a.batch_first ? 0 : 1;
    TORCH_CHECK(
        a.key.sym_size(batch_dim) == query.sym_size(batch_dim),
        "multi_head_attention: query and key must have the same batch size (batch_first=",
        a.batch_first, "); got query ", query.sizes(), ", key ", a.key.sizes());
  }
  TORCH_CHECK(
      a.in_proj_weight.dim() == 2 && a.in_proj_weight.sym_size(0) == 3 * embed_dim &&
          a.in_proj_weight.sym_size(1) == embed_dim,
      "multi_head_attention: in_proj_weight must be [3*embed_dim, embed_dim] = [", 3 * embed_dim,
      ", ", embed_dim, "]; got ", a.in_proj_weight.sizes());
  TORCH_CHECK(
      !a.in_proj_bias.has_value() ||
          (a.in_proj_bias->dim() == 1 && a.in_proj_bias->sym_size(0) == 3 * embed_dim),
      "multi_head_attention: in_proj_bias must be [3*embed_dim] = [", 3 * embed_dim, "]; got ",
      a.in_proj_bias.has_value() ? a.in_proj_bias->sizes() : at::IntArrayRef{});
  TORCH_CHECK(
      a.out_proj_weight.dim() == 2 && a.out_proj_weight.sym_size(0) == embed_dim &&
          a.out_proj_weight.sym_size(1) == embed_dim,
      "multi_head_attention: out_proj_weight must be [embed_dim, embed_dim] = [", embed_dim, ", ",
      embed_dim, "]; got ", a.out_proj_weight.sizes());
  TORCH_CHECK(
      !a.out_proj_bias.has_value() ||
          (a.out_proj_bias->dim() == 1 && a.out_proj_bias->sym_size(0) == embed_dim),
      "multi_head_attention: out_proj_bias must be [embed_dim] = [", embed_dim, "]; got ",
      a.out_proj_bias.has_value() ? a.out_proj_bias->sizes() : at::IntArrayRef{});
  for (const at::Tensor* w : {&a.key, &a.value, &a.in_proj_weight, &a.out_proj_weight}) {
    TORCH_CHECK(
        w->scalar_type() == query.scalar_type(),
        "multi_head_attention: every input and weight must have the query's dtype ",
        query.scalar_type(), "; got ", w->scalar_type());
  }
  if (a.key_padding_mask.has_value()) {
    const at::Tensor& m = *a.key_padding_mask;
    const int64_t want_dim = query.dim() == 3 ? 2 : 1;
    TORCH_CHECK(
        m.dim() == want_dim && m.sym_size(-1) == a.key.sym_size(a.batch_first && query.dim() == 3 ? 1 : 0),
        "multi_head_attention: key_padding_mask must be [batch, Lk] (or [Lk] for unbatched "
        "input); got ", m.sizes(), " for key ", a.key.sizes());
  }
  if (a.attn_mask.has_value()) {
    TORCH_CHECK(
        a.attn_mask->dim() == 2 || a.attn_mask->dim() == 3,
        "multi_head_attention: attn_mask must be 2-D [Lq, Lk] or 3-D [batch*num_heads, Lq, Lk]; "
        "got ", a.attn_mask->sizes());
  }
}

std::tuple<at::Tensor, at::Tensor> multi_head_attention_forward(
    const MultiHeadAttentionArgs& a, MultiHeadAttentionSaved* saved) {
  check_multi_head_attention_inputs(a);
  const bool unbatched = a.query.dim() == 2;
  const at::Tensor query = to_batch_first(a.query, unbatched, a.batch_first);
  const at::Tensor key = to_batch_first(a.key, unbatched, a.batch_first);
  const at::Tensor value = to_batch_first(a.value, unbatched, a.batch_first);
  std::optional<at::Tensor> padding = a.key_padding_mask;
  if (unbatched && padding.has_value()) {
    padding = padding->unsqueeze(0);
  }
  const Geometry g = geometry(query, key, a.num_heads);
  const int64_t embed_dim = a.in_proj_weight.size(1);

  const bool self_attention = a.query.is_same(a.key) && a.key.is_same(a.value);
  const bool shared_kv = !self_attention && a.key.is_same(a.value);
  const at::Tensor query2d = tokens2d(query, g);
  const at::Tensor key2d = self_attention ? query2d : tokens2d(key, g);
  const at::Tensor value2d = (self_attention || shared_kv) ? key2d : tokens2d(value, g);

  at::Tensor q, k, v;
  if (self_attention) {
    const at::Tensor qkv = linear2d(query2d, a.in_proj_weight, a.in_proj_bias);
    q = split_heads(qkv, 0, 3, g.seqlen_q, g);
    k = split_heads(qkv, 1, 3, g.seqlen_q, g);
    v = split_heads(qkv, 2, 3, g.seqlen_q, g);
  } else {
    q = split_heads(
        linear2d(query2d, a.in_proj_weight.narrow(0, 0, embed_dim), rows_of(a.in_proj_bias, 0, embed_dim)),
        0, 1, g.seqlen_q, g);
    if (shared_kv) {
      const at::Tensor kv = linear2d(
          key2d, a.in_proj_weight.narrow(0, embed_dim, 2 * embed_dim),
          rows_of(a.in_proj_bias, embed_dim, 2 * embed_dim));
      k = split_heads(kv, 0, 2, g.seqlen_k, g);
      v = split_heads(kv, 1, 2, g.seqlen_k, g);
    } else {
      k = split_heads(
          linear2d(key2d, a.in_proj_weight.narrow(0, embed_dim, embed_dim),
                   rows_of(a.in_proj_bias, embed_dim, embed_dim)),
          0, 1, g.seqlen_k, g);
      v = split_heads(
          linear2d(value2d, a.in_proj_weight.narrow(0, 2 * embed_dim, embed_dim),
                   rows_of(a.in_proj_bias, 2 * embed_dim, embed_dim)),
          0, 1, g.seqlen_k, g);
    }
  }

  auto [attn, lse, weights] = call_attention_forward(
      q, k, v, a.attn_mask, padding, a.is_causal, std::nullopt, a.need_weights);

  const at::Tensor out2d = linear2d(merge_heads(attn, g), a.out_proj_weight, a.out_proj_bias);
  at::Tensor output = from_batch_first(
      out2d.view_symint({g.batch, g.seqlen_q, g.embed_dim}), unbatched, a.batch_first);
  if (!a.batch_first && !unbatched) {
    output = output.contiguous();  // nn.MultiheadAttention returns a contiguous [L, B, E]
  }
  if (a.need_weights) {
    if (a.average_attn_weights) {
      weights = weights.mean(1);
    }
    if (unbatched) {
      weights = weights.squeeze(0);
    }
  }

  if (saved != nullptr) {
    saved->query2d = query2d;
    saved->key2d = key2d;
    saved->value2d = value2d;
    saved->q = q;
    saved->k = k;
    saved->v = v;
    saved->attn = attn;
    saved->lse = lse;
    saved->attn_mask = a.attn_mask;
    saved->key_padding_mask = padding;
    saved->self_attention = self_attention;
    saved->shared_kv = shared_kv;
    saved->unbatched = unbatched;
  }
  return std::make_tuple(output, weights);
}

std::array<at::Tensor, 7> multi_head_attention_backward(
    const MultiHeadAttentionArgs& a,
    const MultiHeadAttentionSaved& s,
    const at::Tensor& grad_output,
    const at::Tensor& grad_weights,
    const std::array<bool, 7>& needs) {
  enum { kQuery, kKey, kValue, kInWeight, kInBias, kOutWeight, kOutBias };
  std::array<at::Tensor, 7> grads;
  const Geometry g = geometry(
      to_batch_first(a.query, s.unbatched, a.batch_first),
      to_batch_first(a.key, s.unbatched, a.batch_first), a.num_heads);
  const int64_t embed_dim = a.in_proj_weight.size(1);
  const at::Tensor dy = tokens2d(to_batch_first(grad_output, s.unbatched, a.batch_first), g);
  if (needs[kOutWeight]) {
    grads[kOutWeight] = dy.t().mm(merge_heads(s.attn, g));
  }
  if (needs[kOutBias] && a.out_proj_bias.has_value()) {
    grads[kOutBias] = dy.sum(0);
  }
  const bool needs_core = needs[kQuery] || needs[kKey] || needs[kValue] || needs[kInWeight] || needs[kInBias];
  if (!needs_core) {
    return grads;
  }

  std::optional<at::Tensor> grad_probs;
  if (a.need_weights && grad_weights.defined()) {
    at::Tensor gw = s.unbatched ? grad_weights.unsqueeze(0) : grad_weights;
    // Averaged weights are the mean over heads: each head receives 1/H of the gradient.
    grad_probs = a.average_attn_weights ? (gw / a.num_heads).unsqueeze(1) : gw;
  }
  const at::Tensor grad_attn = split_heads(dy.mm(a.out_proj_weight), 0, 1, g.seqlen_q, g);
  auto [dq4, dk4, dv4] = call_attention_backward(
      grad_attn, grad_probs, s.q, s.k, s.v, s.lse, s.attn_mask, s.key_padding_mask, a.is_causal,
      std::nullopt);
  const at::Tensor dq = merge_heads(dq4, g), dk = merge_heads(dk4, g), dv = merge_heads(dv4, g);

  auto restore_shape = [&](const at::Tensor& x2d, const SymInt& seqlen) {
    return from_batch_first(x2d.view_symint({g.batch, seqlen, g.embed_dim}), s.unbatched, a.batch_first);
  };
  // Gradients of one packed projection y = x W^T + b, given dy for the packed rows of W.
  struct Projection {
    at::Tensor grad_input, grad_weight, grad_bias;
  };
  auto project_back = [&](const at::Tensor& dproj, const at::Tensor& x2d, int64_t row0, int64_t rows,
                          bool need_input) {
    Projection r;
    if (need_input) {
      r.grad_input = dproj.mm(a.in_proj_weight.narrow(0, row0, rows));
    }
    if (needs[kInWeight]) {
      r.grad_weight = dproj.t().mm(x2d);
    }
    if (needs[kInBias] && a.in_proj_bias.has_value()) {
      r.grad_bias = dproj.sum(0);
    }
    return r;
  };

  std::vector<Projection> parts;
  if (s.self_attention) {
    parts.push_back(project_back(at::cat({dq, dk, dv}, 1), s.query2d, 0, 3 * embed_dim, needs[kQuery]));
    if (parts[0].grad_input.defined()) {
      grads[kQuery] = restore_shape(parts[0].grad_input, g.seqlen_q);
    }
  } else {
    parts.push_back(project_back(dq, s.query2d, 0, embed_dim, needs[kQuery]));
    if (s.shared_kv) {
      parts.push_back(project_back(at::cat({dk, dv}, 1), s.key2d, embed_dim, 2 * embed_dim, needs[kKey]));
    } else {
      parts.push_back(project_back(dk, s.key2d, embed_dim, embed_dim, needs[kKey]));
      parts.push_back(project_back(dv, s.value2d, 2 * embed_dim, embed_dim, needs[kValue]));
    }
    if (parts[0].grad_input.defined()) {
      grads[kQuery] = restore_shape(parts[0].grad_input, g.seqlen_q);
    }
    if (parts[1].grad_input.defined()) {
      grads[kKey] = restore_shape(parts[1].grad_input, g.seqlen_k);
    }
    if (parts.size() == 3 && parts[2].grad_input.defined()) {
      grads[kValue] = restore_shape(parts[2].grad_input, g.seqlen_k);
    }
  }
  std::vector<at::Tensor> weight_grads, bias_grads;
  for (const Projection& p : parts) {
    weight_grads.push_back(p.grad_weight);
    bias_grads.push_back(p.grad_bias);
  }
  if (needs[kInWeight]) {
    grads[kInWeight] = weight_grads.size() == 1 ? weight_grads[0] : at::cat(weight_grads, 0);
  }
  if (needs[kInBias] && a.in_proj_bias.has_value()) {
    grads[kInBias] = bias_grads.size() == 1 ? bias_grads[0] : at::cat(bias_grads, 0);
  }
  return grads;
}

namespace {

std::tuple<at::Tensor, at::Tensor> multi_head_attention_kernel(
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
  const MultiHeadAttentionArgs args{query, key, value, num_heads, in_proj_weight, in_proj_bias,
                                    out_proj_weight, out_proj_bias, attn_mask, key_padding_mask,
                                    need_weights, average_attn_weights, is_causal, batch_first};
  return multi_head_attention_forward(args, nullptr);
}

}  // namespace

// Device-generic: the projections run on the tensors' device and the core dispatches to its
// device kernel, so one registration per device points at the same function.
TORCH_LIBRARY_IMPL(attn_export, CPU, m) {
  m.impl("multi_head_attention", &multi_head_attention_kernel);
}

TORCH_LIBRARY_IMPL(attn_export, CUDA, m) {
  m.impl("multi_head_attention", &multi_head_attention_kernel);
}

}  // namespace attn_export::ops
