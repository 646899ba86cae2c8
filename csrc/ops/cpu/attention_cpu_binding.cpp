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
#include "../core_args.h"

namespace attn_export::ops {
namespace {

void run_kernel(const AttentionParams& params) {
  TORCH_INTERNAL_ASSERT(cpu::run_attention_forward(params), "the CPU kernels take float32 or float64");
}

void run_kernel(const AttentionBackwardParams& params) {
  TORCH_INTERNAL_ASSERT(cpu::run_attention_backward(params), "the CPU kernels take float32 or float64");
}

ForwardResults attention_forward_cpu(const ForwardArgs& a) {
  const AttentionForward forward = prepare_attention_forward(
      a, accumulation_dtype(a.query.scalar_type()), /*masks_in_compute_dtype=*/true);
  run_kernel(forward.params);
  return attention_forward_results(forward, a.query);
}

CoreGrads attention_backward_cpu(const BackwardArgs& a) {
  const CoreOptions& o = a.options;
  check_attention_inputs(a.query, a.key, a.value, o.attn_mask, o.key_padding_mask);
  check_core_attributes(o);
  check_alibi_slopes(o, a.query.size(1));
  check_attention_backward_inputs(a.grad_output, a.logsumexp, a.query, a.value);
  const int64_t batch = a.query.size(0), heads = a.query.size(1), seqlen_q = a.query.size(2);
  const int64_t seqlen_k = a.key.size(2);

  const at::ScalarType acc = accumulation_dtype(a.query.scalar_type());
  const auto options = a.query.options().dtype(acc);
  const at::Tensor q = kernel_operand(a.query, acc);
  const at::Tensor k = kernel_operand(a.key, acc);
  const at::Tensor v = kernel_operand(a.value, acc);
  const at::Tensor grad_out = kernel_operand(a.grad_output, acc);
  const at::Tensor lse = a.logsumexp.to(acc).contiguous();
  at::Tensor grad_q = empty_grad_like(a.query, options);
  at::Tensor grad_k = empty_kernel_kv_grad(a.key, heads, options);
  at::Tensor grad_v = empty_kernel_kv_grad(a.value, heads, options);
  const auto mask4d = kernel_attn_mask(o.attn_mask, batch, heads, seqlen_q, seqlen_k, acc);
  const auto padding = kernel_padding_mask(o.key_padding_mask, acc);
  const auto alibi_slopes = kernel_alibi_slopes(o, a.query);  // the scores recomputed below include the bias

  std::optional<at::Tensor> gw;
  if (a.grad_weights.has_value() && a.grad_weights->defined()) {
    gw = kernel_operand(a.grad_weights->expand({batch, heads, seqlen_q, seqlen_k}), acc);
  }
  // The flash backward (kernels/cpu/flash_cpu.h) reads the forward's output for rowsum(dO * O);
  // without it the row kernels recompute whole probability rows instead.
  const bool has_output = a.output.has_value() && a.output->defined();
  const at::Tensor out = has_output ? kernel_operand(*a.output, acc) : grad_out;
  AttentionParams forward = make_attention_params(q, k, v, out, lse, std::nullopt, mask4d, padding, o, alibi_slopes);
  if (!has_output) {
    forward.out = nullptr;
  }
  AttentionBackwardParams params =
      make_attention_backward_params(forward, grad_out, gw, grad_q, grad_k, grad_v);
  run_kernel(params);
  const at::ScalarType dtype = a.query.scalar_type();
  return std::make_tuple(grad_q.to(dtype), kv_grad(grad_k, a.key).to(dtype), kv_grad(grad_v, a.value).to(dtype));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_export, CPU, m) {
  m.impl(spec::kOpAttention, &attention_kernel<attention_forward_cpu>);
  m.impl(spec::kOpAttentionForward, &attention_forward_kernel<attention_forward_cpu>);
  m.impl(spec::kOpAttentionBackward, &attention_backward_kernel<attention_backward_cpu>);
}

}  // namespace attn_export::ops
