// The layer on the CPU: the attention kernel runs straight on the projection buffers through
// strides, writing its output where the output projection reads it. No [B, H, L, D] view is
// ever materialized and nothing goes through the dispatcher but the two GEMMs, which is what
// makes one call cheaper than nn.MultiheadAttention's chain of small operators.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../../attention_params.h"
#include "../../attention_spec.h"
#include "../../kernels/cpu/attention_cpu.h"
#include "../attention_binding.h"
#include "../multi_head_attention.h"
#include "projection.h"

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

// Points one [B, H, L, D] slot of the params (pointer and three strides) at a view.
template <typename Ptr>
void point(Ptr& ptr, int64_t& batch_stride, int64_t& head_stride, int64_t& row_stride, const HeadView& v) {
  ptr = const_cast<Ptr>(v.ptr);
  batch_stride = v.batch_stride;
  head_stride = v.head_stride;
  row_stride = v.row_stride;
}

// The layer's geometry, as the CPU kernels see it.
struct Geometry {
  bool batch_first;  // token order (unbatched counts as batch-first)
  int64_t batch, seqlen_q, seqlen_k, embed_dim, heads, head_dim;
};

Geometry geometry_of(const MultiHeadAttentionArgs& a) {
  const bool unbatched = a.query.dim() == 2;
  const int64_t seq_dim = unbatched || !a.batch_first ? 0 : 1;
  const int64_t embed_dim = a.query.size(-1);
  return {a.batch_first || unbatched,
          unbatched ? 1 : a.query.size(a.batch_first ? 0 : 1),
          a.query.size(seq_dim),
          a.key.size(seq_dim),
          embed_dim,
          a.num_heads,
          embed_dim / a.num_heads};
}

// Shapes, q/k/v views of the projection buffers (packed: q|k|v in q_buf), masks and scale.
// Masks are returned so that the caller keeps the converted tensors alive.
struct CoreInputs {
  std::optional<at::Tensor> attn_mask, key_padding_mask;
};

CoreInputs fill_core_params(AttentionParams& p, const MultiHeadAttentionArgs& a, const Geometry& g,
                            bool packed_qkv, const at::Tensor& q_buf, const at::Tensor& kv_buf) {
  const at::ScalarType acc = q_buf.scalar_type();
  p.batch = g.batch;
  p.num_heads = g.heads;
  p.seqlen_q = g.seqlen_q;
  p.seqlen_k = g.seqlen_k;
  p.head_dim = g.head_dim;
  p.head_dim_v = g.head_dim;
  p.dtype = to_data_type(acc);
  const HeadView q = head_view(q_buf, 0, g.batch, g.seqlen_q, g.head_dim, g.batch_first);
  const HeadView k = head_view(kv_buf, packed_qkv ? g.embed_dim : 0, g.batch, g.seqlen_k, g.head_dim, g.batch_first);
  const HeadView v = head_view(kv_buf, packed_qkv ? 2 * g.embed_dim : g.embed_dim, g.batch, g.seqlen_k,
                               g.head_dim, g.batch_first);
  point(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, q);
  point(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, k);
  point(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, v);
  CoreInputs inputs{kernel_attn_mask(a.attn_mask, g.batch, g.heads, g.seqlen_q, g.seqlen_k, acc),
                    kernel_padding_mask(batched_padding_mask(a), acc)};
  if (inputs.attn_mask.has_value()) {
    p.attn_mask = mask_params(*inputs.attn_mask, /*is_key_padding=*/false);
  }
  if (inputs.key_padding_mask.has_value()) {
    p.key_padding_mask = mask_params(*inputs.key_padding_mask, /*is_key_padding=*/true);
  }
  p.scale = resolve_scale(std::nullopt, g.head_dim);
  p.is_causal = a.is_causal;
  return inputs;
}

}  // namespace

MultiHeadAttentionResult multi_head_attention_forward_cpu(const MultiHeadAttentionArgs& a, bool packed_qkv) {
  check_multi_head_attention_inputs(a, packed_qkv);
  const Geometry g = geometry_of(a);
  const int64_t batch = g.batch, seqlen_q = g.seqlen_q, seqlen_k = g.seqlen_k;
  const int64_t embed_dim = g.embed_dim, heads = g.heads;
  const at::ScalarType dtype = a.query.scalar_type(), acc = accumulation_dtype(dtype);
  const std::optional<at::Tensor> padding = batched_padding_mask(a);
  check_attention_masks(batch, heads, seqlen_q, seqlen_k, a.query.device(), a.attn_mask, padding);

  MultiHeadAttentionResult r;
  if (packed_qkv) {
    r.q_proj = project_cpu(a.query.reshape({-1, embed_dim}), a.in_proj_weight, a.in_proj_bias);
    r.kv_proj = at::empty({0}, a.query.options());
  } else {
    r.q_proj = project_cpu(a.query.reshape({-1, embed_dim}), a.in_proj_weight.narrow(0, 0, embed_dim),
                           bias_rows(a.in_proj_bias, 0, embed_dim));
    if (a.key.is_same(a.value)) {
      r.kv_proj = project_cpu(a.key.reshape({-1, embed_dim}), a.in_proj_weight.narrow(0, embed_dim, 2 * embed_dim),
                              bias_rows(a.in_proj_bias, embed_dim, 2 * embed_dim));
    } else {
      r.kv_proj = at::empty({a.key.numel() / embed_dim, 2 * embed_dim}, a.query.options());
      at::Tensor k_half = r.kv_proj.narrow(1, 0, embed_dim), v_half = r.kv_proj.narrow(1, embed_dim, embed_dim);
      project_into_cpu(k_half, a.key.reshape({-1, embed_dim}), a.in_proj_weight.narrow(0, embed_dim, embed_dim),
                       bias_rows(a.in_proj_bias, embed_dim, embed_dim));
      project_into_cpu(v_half, a.value.reshape({-1, embed_dim}),
                       a.in_proj_weight.narrow(0, 2 * embed_dim, embed_dim),
                       bias_rows(a.in_proj_bias, 2 * embed_dim, embed_dim));
    }
  }

  // float16/bfloat16: the kernel computes in float32 on converted copies.
  const at::Tensor q_buf = r.q_proj.to(acc);
  const at::Tensor kv_buf = packed_qkv ? q_buf : r.kv_proj.to(acc);
  const auto options = a.query.options().dtype(acc);
  at::Tensor attn = at::empty({r.q_proj.size(0), embed_dim}, options);
  r.lse = at::empty({batch, heads, seqlen_q}, options);
  // The per-head probabilities, when the caller wants the weights.
  std::optional<at::Tensor> weights;
  if (a.need_weights) {
    weights = at::empty({batch, heads, seqlen_q, seqlen_k}, options);
  }
  AttentionParams p;
  const CoreInputs keep_alive = fill_core_params(p, a, g, packed_qkv, q_buf, kv_buf);
  point(p.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride,
        head_view(attn, 0, batch, seqlen_q, g.head_dim, g.batch_first));
  p.lse = r.lse.data_ptr();
  p.weights = weights.has_value() ? weights->data_ptr() : nullptr;
  TORCH_INTERNAL_ASSERT(cpu::run_attention_forward(p), "the CPU kernels take float32 or float64");

  r.attn = attn.to(dtype);
  r.output = project_cpu(r.attn, a.out_proj_weight, a.out_proj_bias).view(a.query.sizes());
  r.weights = a.need_weights ? finalize_weights(weights->to(dtype), a) : at::empty({0}, a.query.options());
  return r;
}

ProjectionGrads core_backward_cpu(
    const MultiHeadAttentionArgs& a,
    bool packed_qkv,
    const MultiHeadAttentionResult& s,
    const at::Tensor& grad_attn,
    const std::optional<at::Tensor>& grad_probs) {
  const Geometry g = geometry_of(a);
  const at::ScalarType dtype = a.query.scalar_type(), acc = accumulation_dtype(dtype);
  const at::Tensor q_buf = s.q_proj.to(acc);
  const at::Tensor kv_buf = packed_qkv ? q_buf : s.kv_proj.to(acc);
  const at::Tensor grad_out = grad_attn.to(acc).contiguous();
  // The kernel writes dq/dk/dv through the same views into buffers shaped like the projections.
  at::Tensor grad_q = at::empty_like(q_buf);
  at::Tensor grad_kv = packed_qkv ? grad_q : at::empty_like(kv_buf);

  AttentionBackwardParams p;
  const CoreInputs keep_alive = fill_core_params(p, a, g, packed_qkv, q_buf, kv_buf);
  point(p.grad_out, p.grad_out_batch_stride, p.grad_out_head_stride, p.grad_out_row_stride,
        head_view(grad_out, 0, g.batch, g.seqlen_q, g.head_dim, g.batch_first));
  point(p.grad_q, p.grad_q_batch_stride, p.grad_q_head_stride, p.grad_q_row_stride,
        head_view(grad_q, 0, g.batch, g.seqlen_q, g.head_dim, g.batch_first));
  point(p.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride, p.grad_k_row_stride,
        head_view(grad_kv, packed_qkv ? g.embed_dim : 0, g.batch, g.seqlen_k, g.head_dim, g.batch_first));
  point(p.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride, p.grad_v_row_stride,
        head_view(grad_kv, packed_qkv ? 2 * g.embed_dim : g.embed_dim, g.batch, g.seqlen_k, g.head_dim,
                  g.batch_first));
  // The forward's attention output lets the flash backward (kernels/cpu/flash_cpu.h) take
  // rowsum(dO * O) from it. Only where it was kept at full precision: float16/bfloat16 saved it
  // rounded, and rowsum over rounded O misses the bfloat16 gradient bounds of
  // tests/ops/core/test_property.py, so there the row kernels recompute the probabilities in float32.
  // The row kernels (for a gradient of the weights) ignore it.
  at::Tensor attn_out;
  if (s.attn.scalar_type() == acc) {
    attn_out = s.attn.contiguous();
    point(p.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride,
          head_view(attn_out, 0, g.batch, g.seqlen_q, g.head_dim, g.batch_first));
  }
  const at::Tensor lse = s.lse.to(acc).contiguous();
  p.lse = lse.data_ptr();
  at::Tensor gw;
  if (grad_probs.has_value()) {
    gw = grad_probs->to(acc).expand({g.batch, g.heads, g.seqlen_q, g.seqlen_k});
    if (gw.stride(3) != 1) {
      gw = gw.contiguous();
    }
    p.grad_weights = gw.data_ptr();
    p.grad_weights_batch_stride = gw.stride(0);
    p.grad_weights_head_stride = gw.stride(1);
    p.grad_weights_row_stride = gw.stride(2);
  }
  TORCH_INTERNAL_ASSERT(cpu::run_attention_backward(p), "the CPU kernels take float32 or float64");
  return {grad_q.to(dtype), packed_qkv ? at::empty({0}, a.query.options()) : grad_kv.to(dtype)};
}

TORCH_LIBRARY_IMPL(attn_export, CPU, m) {
  m.impl(spec::kOpMultiHeadAttention, &layer_kernel<multi_head_attention_forward_cpu>);
  m.impl(spec::kOpMultiHeadAttentionForward, &layer_forward_kernel<multi_head_attention_forward_cpu>);
  m.impl(spec::kOpMultiHeadAttentionBackward, &layer_backward_op<device_layer_backward<core_backward_cpu>>);
}

}  // namespace attn_export::ops
