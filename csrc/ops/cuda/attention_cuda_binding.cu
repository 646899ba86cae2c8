// CUDA binding of the attention core: tensors -> AttentionParams -> the framework-free kernels
// of csrc/kernels/cuda/, launched on the current stream. Results have exactly the layouts of
// the CPU kernels and of the fake kernels: [B, H, L, D] views of token-major memory, lse
// [B, H, Lq] float32 (float64 for float64 inputs), weights contiguous [B, H, Lq, Lk] in the
// input dtype, or an empty tensor.
//
// Unlike the CPU binding, float16/bfloat16 are not upcast: the kernels read them natively and
// accumulate in float32 (tensor cores for head dims 32/64/128, CUDA cores otherwise). Without the
// preview switch (csrc/kernels/cuda/dispatch_policy.h) every call's inputs are first rewritten so
// that it runs on the paths verified on a GPU (verified_inputs.h).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../../attention_spec.h"
#include "../../kernels/cuda/attention_cuda.h"
#include "../attention_binding.h"
#include "../verified_inputs.h"

namespace attn_export::ops {
namespace {

void check_supported(const AttentionParams& params) {
  const char* why = cuda::attention_params_error(params);
  TORCH_CHECK(why == nullptr, why);
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " (CUDA) failed: ", cudaGetErrorString(err));
}

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

// The forward's scratch memory (split-KV partial results; empty when the dispatch needs none).
at::Tensor forward_workspace(const AttentionParams& params, const at::Tensor& like) {
  const auto bytes = static_cast<int64_t>(cuda::attention_forward_workspace_size(params));
  return at::empty({bytes}, like.options().dtype(at::kByte));
}

void run_forward(const AttentionParams& params, const at::Tensor& like, cudaStream_t stream, const char* what) {
  check_supported(params);
  const at::Tensor workspace = forward_workspace(params, like);
  check_launch(cuda::run_attention_forward(params, workspace.numel() > 0 ? workspace.data_ptr() : nullptr,
                                           static_cast<size_t>(workspace.numel()), stream),
               what);
}

ForwardResults attention_forward_cuda(const ForwardArgs& a) {
  const c10::cuda::CUDAGuard device_guard(a.query.device());
  const ForwardArgs verified = verified_forward_args(a, cuda::attention_preview_enabled());
  // float16/bfloat16 stay as they are: the kernels read them natively.
  const AttentionForward forward =
      prepare_attention_forward(verified, a.query.scalar_type(), /*masks_in_compute_dtype=*/false);
  run_forward(forward.params, a.query, current_stream(a.query), "attention forward");
  return attention_forward_results(forward, a.query);
}

CoreGrads attention_backward_cuda(const BackwardArgs& a) {
  const at::Tensor &grad_output = a.grad_output, &query = a.query, &key = a.key, &value = a.value;
  const at::Tensor& logsumexp = a.logsumexp;
  const std::optional<at::Tensor>&grad_weights = a.grad_weights, &output = a.output;
  check_attention_inputs(query, key, value, a.options.attn_mask, a.options.key_padding_mask);
  check_core_attributes(a.options);
  check_attention_backward_inputs(grad_output, logsumexp, query, value);
  // The kernels' key/value and options (verified_inputs.h); key and value keep their own shapes
  // for the gradients.
  const KernelInputs verified = verified_inputs(query, key, value, a.options, cuda::attention_preview_enabled());
  const CoreOptions& options = verified.options;
  const std::optional<at::Tensor>&attn_mask = options.attn_mask, &key_padding_mask = options.key_padding_mask;
  const c10::cuda::CUDAGuard device_guard(query.device());
  const cudaStream_t stream = current_stream(query);
  const at::ScalarType dtype = query.scalar_type(), acc = accumulation_dtype(dtype);
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t seqlen_k = key.size(2), dim_v = value.size(3);

  const at::Tensor q = kernel_operand(query);
  const at::Tensor k = kernel_operand(verified.key);
  const at::Tensor v = kernel_operand(verified.value);
  const at::Tensor grad_out = kernel_operand(grad_output.to(dtype));
  const at::Tensor lse = logsumexp.to(acc).contiguous();
  // Bool masks are read as bytes; floating masks in their own dtype (the kernels read all four).
  const auto mask4d = kernel_attn_mask(attn_mask, batch, heads, seqlen_q, seqlen_k);
  // ALiBi: the slopes as a float32 [heads] tensor on the device (AttentionParams::alibi_slopes), or none.
  check_alibi_slopes(options, heads);
  const std::optional<at::Tensor> alibi_slopes = kernel_alibi_slopes(options, query);

  // The kernels need the forward's output O for rowsum(dO * O). The autograd functions pass
  // the saved one; a caller that does not is served by one more forward pass, O(L) memory.
  at::Tensor out;
  if (output.has_value() && output->defined()) {
    TORCH_CHECK(output->sizes() == at::IntArrayRef({batch, heads, seqlen_q, dim_v}),
                "attention backward: output must be [batch, heads, Lq, Dv] = [", batch, ", ", heads,
                ", ", seqlen_q, ", ", dim_v, "]; got ", output->sizes());
    out = kernel_operand(output->to(dtype));
  } else {
    out = empty_token_major(batch, heads, seqlen_q, dim_v, query.options());
    at::Tensor lse_again = at::empty_like(lse);
    const AttentionParams forward =
        make_attention_params(q, k, v, out, lse_again, std::nullopt, mask4d, key_padding_mask, options,
                              alibi_slopes);
    run_forward(forward, query, stream, "attention backward (recomputing the output)");
  }

  std::optional<at::Tensor> gw;
  if (grad_weights.has_value() && grad_weights->defined()) {
    at::Tensor expanded = grad_weights->to(acc).expand({batch, heads, seqlen_q, seqlen_k});
    gw = kernel_operand(expanded);
  }
  at::Tensor grad_q = empty_grad_like(query, query.options());
  at::Tensor grad_k = empty_kernel_kv_grad(key, heads, query.options());
  at::Tensor grad_v = empty_kernel_kv_grad(value, heads, query.options());
  AttentionBackwardParams params = make_attention_backward_params(
      make_attention_params(q, k, v, out, lse, std::nullopt, mask4d, key_padding_mask, options, alibi_slopes),
      grad_out, gw, grad_q, grad_k, grad_v);
  params.deterministic = at::globalContext().deterministicAlgorithms();  // torch.use_deterministic_algorithms
  if (params.deterministic && cuda::attention_backward_is_nondeterministic(params)) {
    // Raises under torch.use_deterministic_algorithms(True), warns with warn_only=True, as PyTorch's own ops do.
    at::globalContext().alertNotDeterministic(
        "attn_export's attention backward on CUDA in float16/bfloat16 (its flash kernels add dQ with float "
        "atomics; float32 runs deterministic kernels)");
  }
  at::Tensor workspace = at::empty(
      {static_cast<int64_t>(cuda::attention_backward_workspace_size(params))},
      query.options().dtype(at::kByte));
  check_launch(cuda::run_attention_backward(params, workspace.data_ptr(), stream), "attention backward");
  return std::make_tuple(grad_q, kv_grad(grad_k, key), kv_grad(grad_v, value));
}

}  // namespace

TORCH_LIBRARY_IMPL(attn_export, CUDA, m) {
  m.impl(spec::kOpAttention, &attention_kernel<attention_forward_cuda>);
  m.impl(spec::kOpAttentionForward, &attention_forward_kernel<attention_forward_cuda>);
  m.impl(spec::kOpAttentionBackward, &attention_backward_kernel<attention_backward_cuda>);
}

}  // namespace attn_export::ops
