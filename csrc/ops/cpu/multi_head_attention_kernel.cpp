// The layer on the CPU: the attention kernel runs straight on the projection buffers through
// strides, writing its output where the output projection reads it. No [B, H, L, D] view is
// ever materialized and nothing goes through the dispatcher but the two GEMMs, which is what
// makes one call cheaper than nn.MultiheadAttention's chain of small operators.
#include <ATen/ATen.h>

#include "../../attention_params.h"
#include "../attention_binding.h"
#include "../multi_head_attention.h"
#include "attention_cpu.h"

namespace attn_export::ops {
namespace {

// Strides of the [B, H, L, D] view of a token-major buffer whose rows are `row` apart.
struct HeadView {
  const void* ptr;
  int64_t batch_stride, head_stride, row_stride;
};

HeadView head_view(const at::Tensor& buffer, int64_t column, int64_t batch, int64_t seqlen,
                   int64_t head_dim, bool batch_first) {
  const int64_t row = buffer.stride(0);
  const char* base = static_cast<const char*>(buffer.data_ptr()) + column * buffer.element_size();
  return batch_first ? HeadView{base, seqlen * row, head_dim, row}
                     : HeadView{base, row, head_dim, batch * row};
}

}  // namespace

MultiHeadAttentionResult multi_head_attention_forward_cpu(
    const MultiHeadAttentionArgs& a, bool packed_qkv, bool save_probs) {
  check_multi_head_attention_inputs(a, packed_qkv);
  const bool unbatched = a.query.dim() == 2;
  const bool batch_first = a.batch_first || unbatched;
  const int64_t seq_dim = unbatched || !a.batch_first ? 0 : 1;
  const int64_t batch = unbatched ? 1 : a.query.size(a.batch_first ? 0 : 1);
  const int64_t seqlen_q = a.query.size(seq_dim), seqlen_k = a.key.size(seq_dim);
  const int64_t embed_dim = a.query.size(-1), heads = a.num_heads, head_dim = embed_dim / heads;
  const at::ScalarType dtype = a.query.scalar_type(), acc = accumulation_dtype(dtype);
  const std::optional<at::Tensor> padding = batched_padding_mask(a);
  check_attention_masks(batch, heads, seqlen_q, seqlen_k, a.query.device(), a.attn_mask, padding);

  MultiHeadAttentionResult r;
  if (packed_qkv) {
    r.q_proj = project(a.query.reshape({-1, embed_dim}), a.in_proj_weight, a.in_proj_bias);
    r.kv_proj = at::empty({0}, a.query.options());
  } else {
    r.q_proj = project(a.query.reshape({-1, embed_dim}), a.in_proj_weight.narrow(0, 0, embed_dim),
                       bias_rows(a.in_proj_bias, 0, embed_dim));
    if (a.key.is_same(a.value)) {
      r.kv_proj = project(a.key.reshape({-1, embed_dim}), a.in_proj_weight.narrow(0, embed_dim, 2 * embed_dim),
                          bias_rows(a.in_proj_bias, embed_dim, 2 * embed_dim));
    } else {
      r.kv_proj = at::empty({a.key.numel() / embed_dim, 2 * embed_dim}, a.query.options());
      at::Tensor k_half = r.kv_proj.narrow(1, 0, embed_dim), v_half = r.kv_proj.narrow(1, embed_dim, embed_dim);
      k_half.copy_(project(a.key.reshape({-1, embed_dim}), a.in_proj_weight.narrow(0, embed_dim, embed_dim),
                           bias_rows(a.in_proj_bias, embed_dim, embed_dim)));
      v_half.copy_(project(a.value.reshape({-1, embed_dim}), a.in_proj_weight.narrow(0, 2 * embed_dim, embed_dim),
                           bias_rows(a.in_proj_bias, 2 * embed_dim, embed_dim)));
    }
  }

  // float16/bfloat16: the kernel computes in float32 on converted copies.
  const at::Tensor q_buf = r.q_proj.to(acc);
  const at::Tensor kv_buf = packed_qkv ? q_buf : r.kv_proj.to(acc);
  const auto options = a.query.options().dtype(acc);
  at::Tensor attn = at::empty({r.q_proj.size(0), embed_dim}, options);
  r.lse = at::empty({batch, heads, seqlen_q}, options);
  // The per-head probabilities, when the caller wants the weights or the backward wants them.
  std::optional<at::Tensor> weights;
  if (a.need_weights || save_probs) {
    weights = at::empty({batch, heads, seqlen_q, seqlen_k}, options);
  }
  const auto mask4d = cpu::kernel_attn_mask(a.attn_mask, batch, heads, acc);
  const auto padding_mask = cpu::kernel_padding_mask(padding, acc);

  AttentionParams p;
  p.batch = batch;
  p.num_heads = heads;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.head_dim = head_dim;
  p.head_dim_v = head_dim;
  p.dtype = to_data_type(acc);
  const HeadView q = head_view(q_buf, 0, batch, seqlen_q, head_dim, batch_first);
  const HeadView k = head_view(kv_buf, packed_qkv ? embed_dim : 0, batch, seqlen_k, head_dim, batch_first);
  const HeadView v = head_view(kv_buf, packed_qkv ? 2 * embed_dim : embed_dim, batch, seqlen_k, head_dim, batch_first);
  const HeadView out = head_view(attn, 0, batch, seqlen_q, head_dim, batch_first);
  p.q = q.ptr;
  p.q_batch_stride = q.batch_stride;
  p.q_head_stride = q.head_stride;
  p.q_row_stride = q.row_stride;
  p.k = k.ptr;
  p.k_batch_stride = k.batch_stride;
  p.k_head_stride = k.head_stride;
  p.k_row_stride = k.row_stride;
  p.v = v.ptr;
  p.v_batch_stride = v.batch_stride;
  p.v_head_stride = v.head_stride;
  p.v_row_stride = v.row_stride;
  p.out = const_cast<void*>(out.ptr);
  p.out_batch_stride = out.batch_stride;
  p.out_head_stride = out.head_stride;
  p.out_row_stride = out.row_stride;
  p.lse = r.lse.data_ptr();
  p.weights = weights.has_value() ? weights->data_ptr() : nullptr;
  if (mask4d.has_value()) {
    p.attn_mask = mask_params(*mask4d, /*is_key_padding=*/false);
  }
  if (padding_mask.has_value()) {
    p.key_padding_mask = mask_params(*padding_mask, /*is_key_padding=*/true);
  }
  p.scale = resolve_scale(std::nullopt, head_dim);
  p.is_causal = a.is_causal;
  cpu::run_attention_forward(p);

  r.attn = attn.to(dtype);
  r.output = project(r.attn, a.out_proj_weight, a.out_proj_bias).view(a.query.sizes());
  r.weights = a.need_weights ? finalize_weights(weights->to(dtype), a) : at::empty({0}, a.query.options());
  r.probs = save_probs ? *weights : at::empty({0}, options);
  return r;
}

}  // namespace attn_export::ops
