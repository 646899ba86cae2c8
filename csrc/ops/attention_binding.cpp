#include "attention_binding.h"

#include <cmath>
#include <limits>
#include <string>
#include <string_view>

namespace attn_export::ops {
namespace {

bool is_mask_dtype(at::ScalarType dtype) {
  return dtype == at::kBool || at::isFloatingType(dtype);
}

}  // namespace

AttentionMask mask_params(const at::Tensor& mask, bool is_key_padding) {
  AttentionMask m;
  m.ptr = mask.data_ptr();
  m.kind = mask.scalar_type() == at::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  m.dtype = m.kind == MaskKind::kBool ? DataType::kFloat32 : to_data_type(mask.scalar_type());
  m.batch_stride = mask.stride(0);
  if (is_key_padding) {
    m.col_stride = mask.stride(1);
  } else {
    m.head_stride = mask.stride(1);
    m.row_stride = mask.stride(2);
    m.col_stride = mask.stride(3);
  }
  return m;
}

void check_attention_inputs(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask) {
  TORCH_CHECK(
      query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
      "attention: query, key and value must be 4-D [batch, heads, seq, head_dim]; got query ",
      query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(
      at::isFloatingType(query.scalar_type()) && key.scalar_type() == query.scalar_type() &&
          value.scalar_type() == query.scalar_type(),
      "attention: query, key and value must share one floating dtype; got ", query.scalar_type(),
      ", ", key.scalar_type(), ", ", value.scalar_type());
  TORCH_CHECK(
      key.device() == query.device() && value.device() == query.device(),
      "attention: query, key and value must be on one device; got ", query.device(), ", ",
      key.device(), ", ", value.device());
  TORCH_CHECK(
      key.size(0) == query.size(0) && value.size(0) == query.size(0),
      "attention: query, key and value must agree in batch; got query ", query.sizes(), ", key ",
      key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(
      value.size(1) == key.size(1) &&
          (key.size(1) == query.size(1) || (key.size(1) > 0 && query.size(1) % key.size(1) == 0)),
      "attention: key and value heads must divide the query heads; got query ", query.sizes(),
      ", key ", key.sizes(), ", value ", value.sizes(),
      "; give key and value one head count Hkv with H % Hkv == 0 (grouped-query attention: query "
      "head h reads key/value head h / (H / Hkv))");
  TORCH_CHECK(
      key.size(2) == value.size(2),
      "attention: key and value must have the same sequence length; got key ", key.sizes(),
      " and value ", value.sizes());
  TORCH_CHECK(
      key.size(3) == query.size(3),
      "attention: query and key must have the same head_dim; got query ", query.sizes(),
      " and key ", key.sizes());

  check_attention_masks(query.size(0), query.size(1), query.size(2), key.size(2), query.device(),
                        attn_mask, key_padding_mask);
}

namespace {

// nn.MultiheadAttention's per-(batch, head) mask [batch*heads, Lq, Lk], batch-major. Where
// batch*heads is 1 it is also the broadcasting reading, which then applies.
bool is_flat_batch_heads_mask(const at::Tensor& m, int64_t batch, int64_t heads, int64_t seqlen_q,
                              int64_t seqlen_k) {
  return m.dim() == 3 && batch * heads != 1 && m.size(0) == batch * heads && m.size(1) == seqlen_q &&
      m.size(2) == seqlen_k;
}

// PyTorch's broadcasting (F.scaled_dot_product_attention's rule for masks): aligned from the
// last dim, each size 1 or the target's.
bool broadcasts_to(const at::Tensor& m, at::IntArrayRef target) {
  if (m.dim() > static_cast<int64_t>(target.size())) {
    return false;
  }
  for (int64_t i = 1; i <= m.dim(); ++i) {
    const int64_t size = m.size(-i), want = target[target.size() - i];
    if (size != 1 && size != want) {
      return false;
    }
  }
  return true;
}

// What every mask is checked for first: a dtype the kernels read as a mask, the query's device.
void check_mask_kind(const at::Tensor& m, const char* name, at::Device device) {
  TORCH_CHECK(is_mask_dtype(m.scalar_type()), "attention: ", name, " must be bool or floating; got ", m.scalar_type());
  TORCH_CHECK(m.device() == device, "attention: ", name, " must be on the query's device ", device, "; got ", m.device());
}

}  // namespace

void check_attention_masks(
    int64_t batch,
    int64_t heads,
    int64_t seqlen_q,
    int64_t seqlen_k,
    at::Device device,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask) {
  if (attn_mask.has_value()) {
    const at::Tensor& m = *attn_mask;
    check_mask_kind(m, "attn_mask", device);
    TORCH_CHECK(
        is_flat_batch_heads_mask(m, batch, heads, seqlen_q, seqlen_k) ||
            broadcasts_to(m, {batch, heads, seqlen_q, seqlen_k}),
        "attention: attn_mask must be [batch*heads, Lq, Lk] or broadcastable to "
        "[batch, heads, Lq, Lk] = [",
        batch, ", ", heads, ", ", seqlen_q, ", ", seqlen_k, "]; got ", m.sizes());
  }
  if (key_padding_mask.has_value()) {
    const at::Tensor& m = *key_padding_mask;
    check_mask_kind(m, "key_padding_mask", device);
    TORCH_CHECK(
        m.dim() == 2 && m.size(0) == batch && m.size(1) == seqlen_k,
        "attention: key_padding_mask must be [batch, Lk] = [", batch, ", ", seqlen_k, "]; got ",
        m.sizes());
  }
}

void check_attention_backward_inputs(
    const at::Tensor& grad_output,
    const at::Tensor& logsumexp,
    const at::Tensor& query,
    const at::Tensor& value) {
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t dim_v = value.size(3);
  TORCH_CHECK(
      grad_output.sizes() == at::IntArrayRef({batch, heads, seqlen_q, dim_v}),
      "attention backward: grad_output must be [batch, heads, Lq, Dv] = [", batch, ", ", heads,
      ", ", seqlen_q, ", ", dim_v, "]; got ", grad_output.sizes());
  TORCH_CHECK(
      logsumexp.sizes() == at::IntArrayRef({batch, heads, seqlen_q}),
      "attention backward: logsumexp must be [batch, heads, Lq] = [", batch, ", ", heads, ", ",
      seqlen_q, "]; got ", logsumexp.sizes());
  TORCH_CHECK(
      grad_output.device() == query.device() && logsumexp.device() == query.device(),
      "attention backward: grad_output and logsumexp must be on the query's device ",
      query.device(), "; got ", grad_output.device(), " and ", logsumexp.device());
}

double resolve_scale(std::optional<double> scale, int64_t head_dim) {
  if (scale.has_value()) {
    return *scale;
  }
  return head_dim > 0 ? 1.0 / std::sqrt(static_cast<double>(head_dim)) : 1.0;
}

namespace {

// The trailing attribute's range in the spec, or null when it takes any value of its type.
const spec::AttributeRange* find_range(std::string_view name) {
  for (const spec::AttributeRange& range : spec::kAttributeRanges) {
    if (name == range.name) {
      return &range;
    }
  }
  return nullptr;
}

// What the values must be, as spec.py's AttributeRange.rule words it.
std::string range_words(const spec::AttributeRange& range) {
  if (!range.bounded_above) {
    return c10::str("finite and >= ", range.min, " (", range.meaning, ")");
  }
  const char* joint = range.max == range.min + 1 ? " or " : " to ";
  return c10::str(range.min, joint, range.max, " (", range.meaning, ")");
}

// The value is printed in its own type (a double as ostream prints it: -2, nan, 1e-30).
template <typename T>
void check_attribute_value(const char* name, T value) {
  const spec::AttributeRange* range = find_range(name);
  if (range == nullptr) {
    return;
  }
  const double v = static_cast<double>(value);
  TORCH_CHECK(std::isfinite(v) && v >= range->min && (!range->bounded_above || v <= range->max),
              "attention: ", name, " must be ", range_words(*range), "; got ", value);
}

}  // namespace

#define ATTN_EXPORT_CHECK_ATTRIBUTE(type, name, default_value) check_attribute_value(#name, options.name);

void check_core_attributes(const CoreOptions& options) {
  ATTN_EXPORT_TRAILING_ATTRIBUTES(ATTN_EXPORT_CHECK_ATTRIBUTE)
  // A window is measured back from the causal diagonal, which only is_causal defines.
  TORCH_CHECK(options.window == 0 || options.is_causal, "attention: window > 0 needs is_causal=True (the window ",
              "ends at the causal diagonal); got window=", options.window,
              " with is_causal=False: pass is_causal=True, or window=0 and a boolean attn_mask");
}

#undef ATTN_EXPORT_CHECK_ATTRIBUTE

void check_alibi_slopes(const CoreOptions& options, int64_t num_heads) {
  if (!options.has_alibi()) {
    return;
  }
  const std::vector<double>& slopes = *options.alibi_slopes;
  TORCH_CHECK(static_cast<int64_t>(slopes.size()) == num_heads,
              "attention: alibi_slopes must have one slope per query head (num_heads = ", num_heads, "); got ",
              slopes.size(), " slopes: pass num_heads floats, or None for no ALiBi");
  for (size_t h = 0; h < slopes.size(); ++h) {
    // The kernels read float32: a double beyond float32's range would become inf there.
    TORCH_CHECK(std::isfinite(slopes[h]) && std::fabs(slopes[h]) <= std::numeric_limits<float>::max(),
                "attention: alibi_slopes must be finite float32 numbers; got ", slopes[h], " for head ", h,
                ": pass finite slopes (Bloom and MPT: 2^(-8 (h + 1) / num_heads)), or None for no ALiBi");
  }
}

std::optional<at::Tensor> kernel_alibi_slopes(const CoreOptions& options, const at::Tensor& like) {
  if (!options.has_alibi()) {
    return std::nullopt;
  }
  const std::vector<double>& slopes = *options.alibi_slopes;
  at::Tensor host = at::empty({static_cast<int64_t>(slopes.size())}, at::TensorOptions().dtype(at::kFloat));
  float* data = host.data_ptr<float>();
  for (size_t h = 0; h < slopes.size(); ++h) {
    data[h] = static_cast<float>(slopes[h]);
  }
  return like.device().is_cpu() ? host : host.to(like.device());
}

at::Tensor broadcast_attn_mask(const at::Tensor& mask, int64_t batch, int64_t heads, int64_t seqlen_q,
                               int64_t seqlen_k) {
  if (is_flat_batch_heads_mask(mask, batch, heads, seqlen_q, seqlen_k)) {
    return mask.reshape({batch, heads, seqlen_q, seqlen_k});
  }
  return mask.expand({batch, heads, seqlen_q, seqlen_k});  // stride 0 where it broadcasts
}

at::Tensor empty_token_major(int64_t batch, int64_t heads, int64_t seqlen, int64_t dim,
                             at::TensorOptions options) {
  return at::empty({batch, seqlen, heads, dim}, options).transpose(1, 2);
}

at::Tensor empty_grad_like(const at::Tensor& input, at::TensorOptions options) {
  return input.is_contiguous() ? at::empty(input.sizes(), options)
                               : empty_token_major(input.size(0), input.size(1), input.size(2), input.size(3), options);
}

at::Tensor empty_kernel_kv_grad(const at::Tensor& input, int64_t heads, at::TensorOptions options) {
  if (input.size(1) == heads) {
    return empty_grad_like(input, options);
  }
  return empty_token_major(input.size(0), heads, input.size(2), input.size(3), options);
}

at::Tensor kv_grad(const at::Tensor& kernel_grad, const at::Tensor& input) {
  const int64_t heads_k = input.size(1);
  if (kernel_grad.size(1) == heads_k) {
    return kernel_grad;
  }
  at::Tensor grad = empty_grad_like(input, kernel_grad.options());
  at::sum_out(grad, kernel_grad.unflatten(1, {heads_k, kernel_grad.size(1) / heads_k}), {2});
  return grad;
}

at::ScalarType accumulation_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

DataType to_data_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return DataType::kFloat32;
    case at::kHalf:
      return DataType::kFloat16;
    case at::kBFloat16:
      return DataType::kBFloat16;
    case at::kDouble:
      return DataType::kFloat64;
    default:
      TORCH_CHECK(false, "attention: unsupported dtype ", dtype,
                  "; use float32, float64, float16 or bfloat16");
  }
}

at::Tensor kernel_operand(const at::Tensor& t, std::optional<at::ScalarType> dtype) {
  at::Tensor r = dtype.has_value() && t.scalar_type() != *dtype ? t.to(*dtype) : t;
  return r.size(-1) > 1 && r.stride(-1) != 1 ? r.contiguous() : r;
}

namespace {

at::Tensor mask_in(const at::Tensor& mask, std::optional<at::ScalarType> dtype) {
  return dtype.has_value() && mask.scalar_type() != at::kBool ? mask.to(*dtype) : mask;
}

}  // namespace

std::optional<at::Tensor> kernel_attn_mask(const std::optional<at::Tensor>& mask, int64_t batch,
                                           int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                                           std::optional<at::ScalarType> dtype) {
  if (!mask.has_value()) {
    return std::nullopt;
  }
  return broadcast_attn_mask(mask_in(*mask, dtype), batch, heads, seqlen_q, seqlen_k);
}

std::optional<at::Tensor> kernel_padding_mask(const std::optional<at::Tensor>& mask,
                                              std::optional<at::ScalarType> dtype) {
  if (!mask.has_value()) {
    return std::nullopt;
  }
  return mask_in(*mask, dtype);
}

AttentionForward prepare_attention_forward(const ForwardArgs& a, at::ScalarType compute_dtype,
                                           bool masks_in_compute_dtype) {
  const at::Tensor &query = a.query, &key = a.key, &value = a.value;
  const CoreOptions& o = a.options;
  check_attention_inputs(query, key, value, o.attn_mask, o.key_padding_mask);
  check_core_attributes(o);
  check_alibi_slopes(o, query.size(1));
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t seqlen_k = key.size(2), dim_v = value.size(3);
  const auto acc_options = query.options().dtype(accumulation_dtype(query.scalar_type()));
  const std::optional<at::ScalarType> mask_dtype =
      masks_in_compute_dtype ? std::optional<at::ScalarType>(compute_dtype) : std::nullopt;

  AttentionForward f;
  f.q = kernel_operand(query, compute_dtype);
  f.k = kernel_operand(key, compute_dtype);
  f.v = kernel_operand(value, compute_dtype);
  f.out = empty_token_major(batch, heads, seqlen_q, dim_v, query.options().dtype(compute_dtype));
  f.lse = at::empty({batch, heads, seqlen_q}, acc_options);
  if (a.need_weights) {
    f.weights = at::empty({batch, heads, seqlen_q, seqlen_k}, acc_options);
  }
  f.attn_mask = kernel_attn_mask(o.attn_mask, batch, heads, seqlen_q, seqlen_k, mask_dtype);
  f.key_padding_mask = kernel_padding_mask(o.key_padding_mask, mask_dtype);
  f.alibi_slopes = kernel_alibi_slopes(o, query);
  f.params =
      make_attention_params(f.q, f.k, f.v, f.out, f.lse, f.weights, f.attn_mask, f.key_padding_mask, o, f.alibi_slopes);
  return f;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_results(const AttentionForward& f,
                                                                         const at::Tensor& query) {
  const at::ScalarType dtype = query.scalar_type();
  return std::make_tuple(
      f.out.to(dtype), f.lse, f.weights.has_value() ? f.weights->to(dtype) : at::empty({0}, query.options()));
}

AttentionParams make_attention_params(
    const at::Tensor& q,
    const at::Tensor& k,
    const at::Tensor& v,
    const at::Tensor& out,
    const at::Tensor& lse,
    const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& attn_mask4d,
    const std::optional<at::Tensor>& key_padding_mask,
    const CoreOptions& options,
    const std::optional<at::Tensor>& alibi_slopes) {
  // A caller that forgot the slopes would run without them: never silently.
  TORCH_INTERNAL_ASSERT(alibi_slopes.has_value() == options.has_alibi(),
                        "make_attention_params: pass kernel_alibi_slopes(options, ...) along with options");
  const double scale = resolve_scale(options.scale, q.size(3));
  const bool is_causal = options.is_causal;
  for (const at::Tensor* t : {&q, &k, &v, &out}) {
    TORCH_INTERNAL_ASSERT(t->numel() == 0 || t->size(3) <= 1 || t->stride(3) == 1, "last dim must be contiguous");
  }
  AttentionParams p;
  p.batch = q.size(0);
  p.num_heads = q.size(1);
  p.num_heads_k = k.size(1);
  p.seqlen_q = q.size(2);
  p.seqlen_k = k.size(2);
  p.head_dim = q.size(3);
  p.head_dim_v = v.size(3);
  p.dtype = to_data_type(q.scalar_type());

  point_at(p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride, q);
  point_at(p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, k);
  point_at(p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, v);
  point_at(p.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride, out);

  TORCH_INTERNAL_ASSERT(lse.is_contiguous());
  p.lse = lse.data_ptr();
  if (weights.has_value()) {
    TORCH_INTERNAL_ASSERT(weights->is_contiguous());
    p.weights = weights->data_ptr();
  }
  if (attn_mask4d.has_value()) {
    p.attn_mask = mask_params(*attn_mask4d, /*is_key_padding=*/false);
  }
  if (key_padding_mask.has_value()) {
    p.key_padding_mask = mask_params(*key_padding_mask, /*is_key_padding=*/true);
  }
  p.scale = scale;
  p.is_causal = is_causal;
#define ATTN_EXPORT_COPY_ATTRIBUTE(type, name, default_value) p.name = options.name;
  ATTN_EXPORT_TRAILING_ATTRIBUTES(ATTN_EXPORT_COPY_ATTRIBUTE)
#undef ATTN_EXPORT_COPY_ATTRIBUTE
  if (alibi_slopes.has_value()) {
    TORCH_INTERNAL_ASSERT(alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->is_contiguous() &&
                          alibi_slopes->numel() == p.num_heads && alibi_slopes->device() == q.device());
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
  }
  return p;
}

AttentionBackwardParams make_attention_backward_params(
    const AttentionParams& forward,
    const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& grad_q,
    const at::Tensor& grad_k,
    const at::Tensor& grad_v) {
  for (const at::Tensor* t : {&grad_out, &grad_q, &grad_k, &grad_v}) {
    TORCH_INTERNAL_ASSERT(t->numel() == 0 || t->size(3) <= 1 || t->stride(3) == 1, "last dim must be contiguous");
  }
  AttentionBackwardParams p;
  static_cast<AttentionParams&>(p) = forward;
  point_at(p.grad_out, p.grad_out_batch_stride, p.grad_out_head_stride, p.grad_out_row_stride, grad_out);
  if (grad_weights.has_value()) {
    const at::Tensor& gw = *grad_weights;
    TORCH_INTERNAL_ASSERT(gw.numel() == 0 || gw.size(3) <= 1 || gw.stride(3) == 1, "last dim must be contiguous");
    point_at(p.grad_weights, p.grad_weights_batch_stride, p.grad_weights_head_stride,
             p.grad_weights_row_stride, gw);
  }
  point_at(p.grad_q, p.grad_q_batch_stride, p.grad_q_head_stride, p.grad_q_row_stride, grad_q);
  point_at(p.grad_k, p.grad_k_batch_stride, p.grad_k_head_stride, p.grad_k_row_stride, grad_k);
  point_at(p.grad_v, p.grad_v_batch_stride, p.grad_v_head_stride, p.grad_v_row_stride, grad_v);
  return p;
}

}  // namespace attn_export::ops
