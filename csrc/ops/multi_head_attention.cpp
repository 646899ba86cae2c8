#include "multi_head_attention.h"

#include "dispatch.h"

namespace attn_export::ops {
namespace {

using c10::SymInt;

struct Layout {
  SymInt batch, seqlen_q, seqlen_k, embed_dim, head_dim;
  int64_t num_heads;
  bool batch_first;  // token order of the 2-D views; unbatched inputs count as batch-first
  bool unbatched;
};

Layout layout_of(const MultiHeadAttentionArgs& a) {
  Layout l;
  l.num_heads = a.num_heads;
  l.unbatched = a.query.dim() == 2;
  l.batch_first = a.batch_first || l.unbatched;
  const int64_t seq_dim = l.unbatched ? 0 : (a.batch_first ? 1 : 0);
  l.batch = l.unbatched ? SymInt(1) : a.query.sym_size(a.batch_first ? 0 : 1);
  l.seqlen_q = a.query.sym_size(seq_dim);
  l.seqlen_k = a.key.sym_size(seq_dim);
  l.embed_dim = a.query.sym_size(-1);
  l.head_dim = l.embed_dim / a.num_heads;
  return l;
}

// A weight stored column-major (weight.t() contiguous: FusedMultiheadAttention keeps its
// projection weights so, which lets BLAS read x W^T without repacking W) gets its gradient in
// the same layout, so that autograd accumulates it without a copy.
bool column_major(const at::Tensor& weight) {
  return weight.dim() == 2 && !weight.unsafeGetTensorImpl()->has_symbolic_sizes_strides() &&
      weight.size(0) > 1 && weight.stride(0) == 1;
}

// dL/dW of y = x W^T from dy, laid out like `weight`.
at::Tensor weight_grad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight) {
  return column_major(weight) ? backend_mm(x.t(), dy).t() : backend_mm(dy.t(), x);
}

// Row blocks of a weight gradient, concatenated in the weight's layout.
at::Tensor cat_weight_grads(const std::vector<at::Tensor>& parts, const at::Tensor& weight) {
  if (parts.size() == 1) {
    return parts[0];
  }
  if (!column_major(weight)) {
    return at::cat(parts, 0);
  }
  std::vector<at::Tensor> transposed;
  for (const at::Tensor& p : parts) {
    transposed.push_back(p.t());
  }
  return at::cat(transposed, 1).t();
}

at::Tensor tokens2d(const at::Tensor& t, const Layout& l) {
  return t.reshape_symint({SymInt(-1), l.embed_dim});
}

// [tokens, count * E] -> the index-th [B, H, L, D] block, as a view.
at::Tensor split_heads(const at::Tensor& proj2d, int64_t index, int64_t count, const SymInt& seqlen,
                       const Layout& l) {
  if (l.batch_first) {
    return proj2d.view_symint({l.batch, seqlen, count, l.num_heads, l.head_dim})
        .select(2, index)
        .transpose(1, 2);
  }
  return proj2d.view_symint({seqlen, l.batch, count, l.num_heads, l.head_dim})
      .select(2, index)
      .permute({1, 2, 0, 3});
}

// [B, H, L, D] -> [tokens, E]. The core's results are [B, L, H, D] in memory: a view for
// batch-first, a copy for sequence-first.
at::Tensor merge_heads(const at::Tensor& t, const Layout& l) {
  const at::Tensor tokens = l.batch_first ? t.transpose(1, 2) : t.permute({2, 0, 1, 3});
  return tokens.reshape_symint({SymInt(-1), l.embed_dim});
}

// [tokens, E] -> the caller's shape.
at::Tensor restore_shape(const at::Tensor& x2d, const SymInt& seqlen, const Layout& l) {
  if (l.unbatched) {
    return x2d.view_symint({seqlen, l.embed_dim});
  }
  return l.batch_first ? x2d.view_symint({l.batch, seqlen, l.embed_dim})
                       : x2d.view_symint({seqlen, l.batch, l.embed_dim});
}

}  // namespace

void check_multi_head_attention_inputs(const MultiHeadAttentionArgs& a, bool packed_qkv) {
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
    // nn.MultiheadAttention's shapes, exactly (plus [1, Lq, Lk]): the core op's broadcasting
    // would read a [num_heads, Lq, Lk] mask per head, where stock refuses it.
    const at::Tensor& m = *a.attn_mask;
    const bool batched = query.dim() == 3;
    const int64_t seq_dim = batched && !a.batch_first ? 0 : (batched ? 1 : 0);
    const c10::SymInt batch = batched ? query.sym_size(a.batch_first ? 0 : 1) : c10::SymInt(1);
    TORCH_CHECK(
        (m.dim() == 2 || (m.dim() == 3 && (m.sym_size(0) == 1 || m.sym_size(0) == batch * a.num_heads))) &&
            m.sym_size(-2) == query.sym_size(seq_dim) && m.sym_size(-1) == a.key.sym_size(seq_dim),
        "multi_head_attention: attn_mask must be 2-D [Lq, Lk] or 3-D [batch*num_heads, Lq, Lk]; "
        "got ", m.sizes(), " for query ", query.sizes(), " and key ", a.key.sizes());
  }
  TORCH_CHECK(
      !packed_qkv || (a.key.sym_sizes() == query.sym_sizes() && a.value.sym_sizes() == query.sym_sizes()),
      "multi_head_attention: packed_qkv needs key and value of the query's shape ", query.sizes(),
      "; got key ", a.key.sizes(), ", value ", a.value.sizes());
}

std::optional<at::Tensor> batched_padding_mask(const MultiHeadAttentionArgs& a) {
  if (a.key_padding_mask.has_value() && a.query.dim() == 2) {
    return a.key_padding_mask->unsqueeze(0);
  }
  return a.key_padding_mask;
}

at::Tensor finalize_weights(const at::Tensor& weights, const MultiHeadAttentionArgs& a) {
  if (!a.need_weights) {
    return weights;
  }
  at::Tensor w = a.average_attn_weights ? weights.mean(1) : weights;
  return a.query.dim() == 2 ? w.squeeze(0) : w;
}

MultiHeadAttentionResult multi_head_attention_forward(const MultiHeadAttentionArgs& a, bool packed_qkv) {
  check_multi_head_attention_inputs(a, packed_qkv);
  const Layout l = layout_of(a);
  const int64_t embed_dim = a.in_proj_weight.size(1);
  MultiHeadAttentionResult r;

  at::Tensor q, k, v;
  if (packed_qkv) {
    r.q_proj = project(tokens2d(a.query, l), a.in_proj_weight, a.in_proj_bias);
    r.kv_proj = at::empty({0}, a.query.options());
    q = split_heads(r.q_proj, 0, 3, l.seqlen_q, l);
    k = split_heads(r.q_proj, 1, 3, l.seqlen_q, l);
    v = split_heads(r.q_proj, 2, 3, l.seqlen_q, l);
  } else {
    r.q_proj = project(tokens2d(a.query, l), a.in_proj_weight.narrow(0, 0, embed_dim),
                        bias_rows(a.in_proj_bias, 0, embed_dim));
    if (a.key.is_same(a.value)) {
      r.kv_proj = project(tokens2d(a.key, l), a.in_proj_weight.narrow(0, embed_dim, 2 * embed_dim),
                           bias_rows(a.in_proj_bias, embed_dim, 2 * embed_dim));
    } else {
      r.kv_proj = at::cat(
          {project(tokens2d(a.key, l), a.in_proj_weight.narrow(0, embed_dim, embed_dim),
                    bias_rows(a.in_proj_bias, embed_dim, embed_dim)),
           project(tokens2d(a.value, l), a.in_proj_weight.narrow(0, 2 * embed_dim, embed_dim),
                    bias_rows(a.in_proj_bias, 2 * embed_dim, embed_dim))},
          1);
    }
    q = split_heads(r.q_proj, 0, 1, l.seqlen_q, l);
    k = split_heads(r.kv_proj, 0, 2, l.seqlen_k, l);
    v = split_heads(r.kv_proj, 1, 2, l.seqlen_k, l);
  }

  auto [attn, lse, weights] =
      call_attention_forward({q, k, v, {a.attn_mask, batched_padding_mask(a), a.is_causal}, a.need_weights});
  r.attn = merge_heads(attn, l);
  r.lse = lse;
  r.output = restore_shape(project(r.attn, a.out_proj_weight, a.out_proj_bias), l.seqlen_q, l);
  r.weights = a.need_weights ? finalize_weights(weights, a) : at::empty({0}, a.query.options());
  return r;
}

ProjectionGrads core_backward(
    const MultiHeadAttentionArgs& a,
    bool packed_qkv,
    const MultiHeadAttentionResult& s,
    const at::Tensor& grad_attn,
    const std::optional<at::Tensor>& grad_probs) {
  const Layout l = layout_of(a);
  at::Tensor q, k, v;
  if (packed_qkv) {
    q = split_heads(s.q_proj, 0, 3, l.seqlen_q, l);
    k = split_heads(s.q_proj, 1, 3, l.seqlen_q, l);
    v = split_heads(s.q_proj, 2, 3, l.seqlen_q, l);
  } else {
    q = split_heads(s.q_proj, 0, 1, l.seqlen_q, l);
    k = split_heads(s.kv_proj, 0, 2, l.seqlen_k, l);
    v = split_heads(s.kv_proj, 1, 2, l.seqlen_k, l);
  }
  auto [dq4, dk4, dv4] = call_attention_backward(
      {split_heads(grad_attn, 0, 1, l.seqlen_q, l), grad_probs, q, k, v, s.lse, split_heads(s.attn, 0, 1, l.seqlen_q, l),
       {a.attn_mask, batched_padding_mask(a), a.is_causal}});
  const at::Tensor dq = merge_heads(dq4, l), dk = merge_heads(dk4, l), dv = merge_heads(dv4, l);
  if (packed_qkv) {
    return {at::cat({dq, dk, dv}, 1), at::empty({0}, dq.options())};
  }
  return {dq, at::cat({dk, dv}, 1)};
}

std::array<at::Tensor, 7> multi_head_attention_backward(
    const MultiHeadAttentionArgs& a,
    bool packed_qkv,
    bool shared_kv,
    const MultiHeadAttentionResult& s,
    const at::Tensor& grad_output,
    const at::Tensor& grad_weights,
    const std::array<bool, 7>& needs,
    CoreBackwardFn core) {
  enum { kQuery, kKey, kValue, kInWeight, kInBias, kOutWeight, kOutBias };
  std::array<at::Tensor, 7> grads;
  const Layout l = layout_of(a);
  const int64_t embed_dim = a.in_proj_weight.size(1);

  const at::Tensor dy = tokens2d(grad_output, l);
  if (needs[kOutWeight]) {
    grads[kOutWeight] = weight_grad(dy, s.attn, a.out_proj_weight);
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
    at::Tensor gw = l.unbatched ? grad_weights.unsqueeze(0) : grad_weights;
    // Averaged weights are the mean over heads: each head receives 1/H of the gradient.
    grad_probs = a.average_attn_weights ? (gw / a.num_heads).unsqueeze(1) : gw;
  }
  const ProjectionGrads d = core(a, packed_qkv, s, backend_mm(dy, a.out_proj_weight), grad_probs);

  // Gradients of one packed projection y = x W[rows]^T + b[rows], given dy.
  struct Projection {
    at::Tensor grad_input, grad_weight, grad_bias;
  };
  auto project_back = [&](const at::Tensor& dproj, const at::Tensor& input, int64_t row0, int64_t rows,
                          bool need_input) {
    Projection p;
    if (need_input) {
      p.grad_input = backend_mm(dproj, a.in_proj_weight.narrow(0, row0, rows));
    }
    if (needs[kInWeight]) {
      p.grad_weight = weight_grad(dproj, tokens2d(input, l), a.in_proj_weight);
    }
    if (needs[kInBias] && a.in_proj_bias.has_value()) {
      p.grad_bias = dproj.sum(0);
    }
    return p;
  };

  std::vector<Projection> parts;
  if (packed_qkv) {
    parts.push_back(project_back(d.q_proj, a.query, 0, 3 * embed_dim, needs[kQuery]));
  } else {
    parts.push_back(project_back(d.q_proj, a.query, 0, embed_dim, needs[kQuery]));
    if (shared_kv) {
      parts.push_back(project_back(d.kv_proj, a.key, embed_dim, 2 * embed_dim, needs[kKey]));
    } else {
      parts.push_back(project_back(d.kv_proj.narrow(1, 0, embed_dim), a.key, embed_dim, embed_dim, needs[kKey]));
      parts.push_back(project_back(d.kv_proj.narrow(1, embed_dim, embed_dim), a.value, 2 * embed_dim,
                                   embed_dim, needs[kValue]));
    }
  }
  const std::array<SymInt, 3> seqlens = {l.seqlen_q, l.seqlen_k, l.seqlen_k};
  std::vector<at::Tensor> weight_grads, bias_grads;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i].grad_input.defined()) {
      grads[kQuery + i] = restore_shape(parts[i].grad_input, seqlens[i], l);
    }
    weight_grads.push_back(parts[i].grad_weight);
    bias_grads.push_back(parts[i].grad_bias);
  }
  if (needs[kInWeight]) {
    grads[kInWeight] = cat_weight_grads(weight_grads, a.in_proj_weight);
  }
  if (needs[kInBias] && a.in_proj_bias.has_value()) {
    grads[kInBias] = bias_grads.size() == 1 ? bias_grads[0] : at::cat(bias_grads, 0);
  }
  return grads;
}

}  // namespace attn_export::ops
