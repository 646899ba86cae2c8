// Test-only operators that run the CUDA kernels under the SIMT emulator on CPU tensors:
// torch.ops.attn_export_emu.{forward, backward, uses_tensor_cores}. They mirror the CUDA
// binding (csrc/ops/cuda/attention_cuda_binding.cu) step for step, minus the device guard and
// stream; the forward's setup is the bindings' own (prepare_attention_forward).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "kernels/cuda/attention_cuda.h"
#include "ops/attention_binding.h"

namespace attn_export::ops {
namespace {

void check(cudaError_t err, const AttentionParams& params) {
  const char* why = cuda::attention_params_error(params);
  TORCH_CHECK(why == nullptr, why);
  TORCH_CHECK(err == cudaSuccess, "emulated kernels failed: ", static_cast<int>(err));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, std::optional<double> scale, bool need_weights, double softcap) {
  const AttentionForward f = prepare_attention_forward(
      query, key, value, attn_mask, key_padding_mask, is_causal, scale, need_weights, query.scalar_type(),
      /*masks_in_compute_dtype=*/false, softcap);
  check(cuda::run_attention_forward(f.params, nullptr), f.params);
  return attention_forward_results(f, query);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_output, const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& logsumexp,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, std::optional<double> scale, double softcap) {
  check_attention_inputs(query, key, value, attn_mask, key_padding_mask);
  check_softcap(softcap);
  check_attention_backward_inputs(grad_output, logsumexp, query, value);
  const at::ScalarType dtype = query.scalar_type(), acc = accumulation_dtype(dtype);
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t seqlen_k = key.size(2), dim = query.size(3), dim_v = value.size(3);
  const double softmax_scale = resolve_scale(scale, dim);
  const at::Tensor q = kernel_operand(query), k = kernel_operand(key), v = kernel_operand(value);
  const at::Tensor grad_out = kernel_operand(grad_output.to(dtype));
  const at::Tensor lse = logsumexp.to(acc).contiguous();
  const auto mask4d = kernel_attn_mask(attn_mask, batch, heads);

  at::Tensor out = empty_token_major(batch, heads, seqlen_q, dim_v, query.options());
  {
    at::Tensor lse_again = at::empty_like(lse);
    const AttentionParams forward = make_attention_params(
        q, k, v, out, lse_again, std::nullopt, mask4d, key_padding_mask, softmax_scale, is_causal, softcap);
    check(cuda::run_attention_forward(forward, nullptr), forward);
  }
  std::optional<at::Tensor> gw;
  if (grad_weights.has_value() && grad_weights->defined()) {
    gw = kernel_operand(grad_weights->to(acc).expand({batch, heads, seqlen_q, seqlen_k}));
  }
  at::Tensor grad_q = empty_token_major(batch, heads, seqlen_q, dim, query.options());
  at::Tensor grad_k = empty_token_major(batch, heads, seqlen_k, dim, query.options());
  at::Tensor grad_v = empty_token_major(batch, heads, seqlen_k, dim_v, query.options());
  const AttentionBackwardParams params = make_attention_backward_params(
      make_attention_params(q, k, v, out, lse, std::nullopt, mask4d, key_padding_mask, softmax_scale, is_causal,
                            softcap),
      grad_out, gw, grad_q, grad_k, grad_v);
  // Filled with garbage: the kernels must not rely on a zeroed workspace.
  at::Tensor workspace = at::full(
      {static_cast<int64_t>(cuda::attention_backward_workspace_size(params)) + 256}, 0x7f, query.options().dtype(at::kByte));
  void* aligned = reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(workspace.data_ptr()) + 255) / 256 * 256);
  check(cuda::run_attention_backward(params, aligned, nullptr), params);
  return std::make_tuple(grad_q, grad_k, grad_v);
}

bool uses_tensor_cores(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  const at::Tensor q = kernel_operand(query), k = kernel_operand(key), v = kernel_operand(value);
  at::Tensor out = empty_token_major(q.size(0), q.size(1), q.size(2), v.size(3), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  return cuda::attention_uses_tensor_cores(
      make_attention_params(q, k, v, out, lse, std::nullopt, std::nullopt, std::nullopt, 1.0, false));
}

}  // namespace

TORCH_LIBRARY(attn_export_emu, m) {
  m.def("forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor? key_padding_mask, "
        "bool is_causal, float? scale, bool need_weights, float softcap=0.0) -> (Tensor, Tensor, Tensor)");
  m.def("backward(Tensor grad_output, Tensor? grad_weights, Tensor query, Tensor key, Tensor value, "
        "Tensor logsumexp, Tensor? attn_mask, Tensor? key_padding_mask, bool is_causal, float? scale, "
        "float softcap=0.0) -> (Tensor, Tensor, Tensor)");
  m.def("uses_tensor_cores(Tensor query, Tensor key, Tensor value) -> bool");
}

TORCH_LIBRARY_IMPL(attn_export_emu, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}

TORCH_LIBRARY_IMPL(attn_export_emu, CompositeExplicitAutograd, m) {
  m.impl("uses_tensor_cores", &uses_tensor_cores);
}

}  // namespace attn_export::ops
