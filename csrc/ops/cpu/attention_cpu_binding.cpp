// CPU binding of the attention core: tensors -> AttentionParams -> the framework-free kernels
// of csrc/kernels/cpu/ (attention_cpu.h). float16/bfloat16 inputs are converted to float32
// (and back) here: the CPU kernels compute in the accumulation dtype. Results have exactly
// the layouts of the CUDA binding and of the fake kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../../attention_spec.h"
#include "../../kernels/cpu/attention_cpu.h"
#include "../attention_binding.h"

namespace attn_export::ops {
namespace {

void run_kernel(const AttentionParams& params) {
  TORCH_INTERNAL_ASSERT(cpu::run_attention_forward(params), "the CPU kernels take float32 or float64");
}

void run_kernel(const AttentionBackwardParams& params) {
  TORCH_INTERNAL_ASSERT(cpu::run_attention_backward(params), "the CPU kernels take float32 or float64");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_cpu(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale,
    bool need_weights,
    double softcap) {
  const AttentionForward forward = prepare_attention_forward(
      query, key, value, attn_mask, key_padding_mask, is_causal, scale, need_weights,
      accumulation_dtype(query.scalar_type()), /*masks_in_compute_dtype=*/true, softcap);
  run_kernel(forward.params);
  return attention_forward_results(forward, query);
}

at::Tensor attention_cpu(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale,
    double softcap) {
  return std::get<0>(attention_forward_cpu(
      query, key, value, attn_mask, key_padding_mask, is_causal, scale, /*need_weights=*/false, softcap));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_output,
    const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal,
    std::optional<double> scale,
    const std::optional<at::Tensor>& output,
    double softcap) {
  check_attention_inputs(query, key, value, attn_mask, key_padding_mask);
  check_softcap(softcap);
  check_attention_backward_inputs(grad_output, logsumexp, query, value);
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t seqlen_k = key.size(2);

  const at::ScalarType acc = accumulation_dtype(query.scalar_type());
  const auto options = query.options().dtype(acc);
  const at::Tensor q = kernel_operand(query, acc);
  const at::Tensor k = kernel_operand(key, acc);
  const at::Tensor v = kernel_operand(value, acc);
  const at::Tensor grad_out = kernel_operand(grad_output, acc);
  const at::Tensor lse = logsumexp.to(acc).contiguous();
  at::Tensor grad_q = empty_grad_like(query, options);
  at::Tensor grad_k = empty_grad_like(key, options);
  at::Tensor grad_v = empty_grad_like(value, options);
  const auto mask4d = kernel_attn_mask(attn_mask, batch, heads, seqlen_q, seqlen_k, acc);
  const auto padding = kernel_padding_mask(key_padding_mask, acc);

  std::optional<at::Tensor> gw;
  if (grad_weights.has_value() && grad_weights->defined()) {
    gw = kernel_operand(grad_weights->expand({batch, heads, seqlen_q, seqlen_k}), acc);
  }
  // The flash backward (kernels/cpu/flash_cpu.h) reads the forward's output for rowsum(dO * O);
  // without it the row kernels recompute whole probability rows instead.
  const bool has_output = output.has_value() && output->defined();
  const at::Tensor out = has_output ? kernel_operand(*output, acc) : grad_out;
  AttentionParams forward = make_attention_params(
      q, k, v, out, lse, std::nullopt, mask4d, padding, resolve_scale(scale, query.size(3)),
      is_causal, softcap);
  if (!has_output) {
    forward.out = nullptr;
  }
  AttentionBackwardParams params =
      make_attention_backward_params(forward, grad_out, gw, grad_q, grad_k, grad_v);
  run_kernel(params);
  const at::ScalarType dtype = query.scalar_type();
  return std::make_tuple(grad_q.to(dtype), grad_k.to(dtype), grad_v.to(dtype));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_export, CPU, m) {
  m.impl(spec::kOpAttention, &attention_cpu);
  m.impl(spec::kOpAttentionForward, &attention_forward_cpu);
  m.impl(spec::kOpAttentionBackward, &attention_backward_cpu);
}

}  // namespace attn_export::ops
