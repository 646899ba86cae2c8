// Test-only operators that run the CUDA kernels under the SIMT emulator on CPU tensors:
// torch.ops.attn_export_emu.{forward, backward, uses_tensor_cores, forward_workspace_size, packs_query_heads,
// forward_block_m}. They mirror the CUDA
// binding (csrc/ops/cuda/attention_cuda_binding.cu) step for step, minus the device guard and
// stream; the forward's setup is the bindings' own (prepare_attention_forward). Every tensor
// the kernels see lives in guarded memory (guarded_memory.h): the inputs are copied there first.
// set_arch, set_cp_async_order and set_schedule choose the emulated device, the cp.async ordering
// and the order the block's threads run in (simt_emulator.h),
// set_sm_count its number of SMs (which decides split-KV), set_preview the preview switch
// (csrc/kernels/cuda/dispatch_policy.h; off unless ATTN_EXPORT_CUDA_PREVIEW=1, as on a GPU).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "guarded_memory_scope.h"
#include "kernels/cuda/attention_cuda.h"
#include "ops/attention_binding.h"
#include "ops/verified_inputs.h"
#include "simt_emulator.h"

namespace attn_export::ops {
namespace {

void check(cudaError_t err, const AttentionParams& params) {
  const char* why = cuda::attention_params_error(params);
  TORCH_CHECK(why == nullptr, why);
  TORCH_CHECK(err == cudaSuccess, "emulated kernels failed: ", cudaGetErrorString(err), ": ",
              simt_emulator::first_error());
}

// One emulated op: guarded allocations, a clean error state, and no failure left unreported
// (one the host code did not turn into an error code still fails the op).
struct EmulatedCall {
  EmulatedCall() { simt_emulator::reset_errors(); }
  void finish() const {
    const std::string error = simt_emulator::first_error();
    TORCH_CHECK(error.empty(), "emulated kernels failed: ", error);
  }
  guarded_memory::Scope guarded;
};

std::optional<at::Tensor> guarded(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(guarded_memory::guarded_copy(*t)) : std::nullopt;
}

// The schema's `float[]? alibi_slopes` as CoreOptions holds it.
std::optional<std::vector<double>> slopes_of(const std::optional<at::ArrayRef<double>>& slopes) {
  return slopes.has_value() ? std::optional<std::vector<double>>(slopes->vec()) : std::nullopt;
}

// Exactly `bytes` between guards, 256-byte aligned by the guarded allocator, and filled with
// garbage: the kernels must not rely on a zeroed workspace.
at::Tensor garbage_workspace(size_t bytes, const at::Tensor& like) {
  at::Tensor workspace = at::full({static_cast<int64_t>(bytes)}, 0x7f, like.options().dtype(at::kByte));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(workspace.data_ptr()) % 256 == 0, "workspace not 256-byte aligned");
  return workspace;
}

// The forward as the CUDA binding runs it: with the workspace the dispatch asks for.
void run_forward(const AttentionParams& params, const at::Tensor& like) {
  const char* why = cuda::attention_params_error(params);
  TORCH_CHECK(why == nullptr, why);
  const size_t bytes = cuda::attention_forward_workspace_size(params);
  const at::Tensor workspace = garbage_workspace(bytes, like);
  check(cuda::run_attention_forward(params, bytes > 0 ? workspace.data_ptr() : nullptr, bytes, nullptr), params);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(
    const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in,
    const std::optional<at::Tensor>& attn_mask_in, const std::optional<at::Tensor>& key_padding_mask_in,
    bool is_causal, std::optional<double> scale, bool need_weights, double softcap, int64_t causal_alignment,
    int64_t window, std::optional<at::ArrayRef<double>> alibi_slopes) {
  EmulatedCall call;
  const at::Tensor query = guarded_memory::guarded_copy(query_in), key = guarded_memory::guarded_copy(key_in),
                   value = guarded_memory::guarded_copy(value_in);
  const auto attn_mask = guarded(attn_mask_in), key_padding_mask = guarded(key_padding_mask_in);
  const ForwardArgs routed = verified_forward_args(
      {query, key, value,
       {attn_mask, key_padding_mask, is_causal, scale, softcap, causal_alignment, window, slopes_of(alibi_slopes)},
       need_weights},
      cuda::attention_preview_enabled());
  const AttentionForward f = prepare_attention_forward(routed, query.scalar_type(), /*masks_in_compute_dtype=*/false);
  run_forward(f.params, query);
  call.finish();
  return attention_forward_results(f, query);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& grad_output_in, const std::optional<at::Tensor>& grad_weights_in,
    const at::Tensor& query_in, const at::Tensor& key_in, const at::Tensor& value_in, const at::Tensor& logsumexp_in,
    const std::optional<at::Tensor>& attn_mask_in, const std::optional<at::Tensor>& key_padding_mask_in,
    bool is_causal, std::optional<double> scale, double softcap, int64_t causal_alignment, int64_t window,
    std::optional<at::ArrayRef<double>> alibi_slopes) {
  EmulatedCall call;
  using guarded_memory::guarded_copy;
  const at::Tensor grad_output = guarded_copy(grad_output_in), query = guarded_copy(query_in),
                   key = guarded_copy(key_in), value = guarded_copy(value_in), logsumexp = guarded_copy(logsumexp_in);
  const auto grad_weights = guarded(grad_weights_in), attn_mask = guarded(attn_mask_in),
             key_padding_mask = guarded(key_padding_mask_in);
  const CoreOptions given{attn_mask,       key_padding_mask, is_causal, scale, softcap, causal_alignment,
                          window,          slopes_of(alibi_slopes)};
  check_attention_inputs(query, key, value, attn_mask, key_padding_mask);
  check_core_attributes(given);
  check_attention_backward_inputs(grad_output, logsumexp, query, value);
  const KernelInputs route = verified_inputs(query, key, value, given, cuda::attention_preview_enabled());
  const CoreOptions& options = route.options;
  const at::ScalarType dtype = query.scalar_type(), acc = accumulation_dtype(dtype);
  const int64_t batch = query.size(0), heads = query.size(1), seqlen_q = query.size(2);
  const int64_t seqlen_k = key.size(2), dim_v = value.size(3);
  const at::Tensor q = kernel_operand(query), k = kernel_operand(route.key), v = kernel_operand(route.value);
  const at::Tensor grad_out = kernel_operand(grad_output.to(dtype));
  const at::Tensor lse = logsumexp.to(acc).contiguous();
  const auto mask4d = kernel_attn_mask(options.attn_mask, batch, heads, seqlen_q, seqlen_k);
  check_alibi_slopes(options, heads);
  const std::optional<at::Tensor> slopes = guarded(kernel_alibi_slopes(options, query));

  at::Tensor out = empty_token_major(batch, heads, seqlen_q, dim_v, query.options());
  {
    at::Tensor lse_again = at::empty_like(lse);
    const AttentionParams forward =
        make_attention_params(q, k, v, out, lse_again, std::nullopt, mask4d, options.key_padding_mask, options,
                              slopes);
    run_forward(forward, query);
  }
  std::optional<at::Tensor> gw;
  if (grad_weights.has_value() && grad_weights->defined()) {
    gw = kernel_operand(grad_weights->to(acc).expand({batch, heads, seqlen_q, seqlen_k}));
  }
  // The layout of the caller's inputs decides, as in the CUDA binding (the guarded copies may differ).
  at::Tensor grad_q = empty_grad_like(query_in, query.options());
  at::Tensor grad_k = empty_kernel_kv_grad(key_in, heads, query.options());
  at::Tensor grad_v = empty_kernel_kv_grad(value_in, heads, query.options());
  const AttentionBackwardParams params = make_attention_backward_params(
      make_attention_params(q, k, v, out, lse, std::nullopt, mask4d, options.key_padding_mask, options, slopes),
      grad_out, gw, grad_q, grad_k, grad_v);
  const at::Tensor workspace = garbage_workspace(cuda::attention_backward_workspace_size(params), query);
  check(cuda::run_attention_backward(params, workspace.data_ptr(), nullptr), params);
  call.finish();
  return std::make_tuple(grad_q, kv_grad(grad_k, key_in), kv_grad(grad_v, value_in));
}

bool uses_tensor_cores(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  const at::Tensor q = kernel_operand(query), k = kernel_operand(key), v = kernel_operand(value);
  at::Tensor out = empty_token_major(q.size(0), q.size(1), q.size(2), v.size(3), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  return cuda::attention_uses_tensor_cores(
      make_attention_params(q, k, v, out, lse, std::nullopt, std::nullopt, std::nullopt, CoreOptions{}));
}

// The forward's params for these inputs, as the CUDA binding routes them (its tensors kept alive in `f`).
AttentionForward routed_forward(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                bool is_causal, int64_t causal_alignment) {
  CoreOptions options;
  options.is_causal = is_causal;
  options.causal_alignment = causal_alignment;
  const ForwardArgs routed = verified_forward_args({query, key, value, options, false}, cuda::attention_preview_enabled());
  return prepare_attention_forward(routed, query.scalar_type(), /*masks_in_compute_dtype=*/false);
}

// Bytes of forward workspace (split-KV partial results) the dispatch asks for on these inputs (0: no split).
int64_t forward_workspace_size(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               bool is_causal, int64_t causal_alignment) {
  const AttentionForward f = routed_forward(query, key, value, is_causal, causal_alignment);
  return static_cast<int64_t>(cuda::attention_forward_workspace_size(f.params));
}

// Whether the dispatch packs grouped query heads into the flash forward's tiles on these inputs.
bool packs_query_heads(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool is_causal,
                       int64_t causal_alignment) {
  const AttentionForward f = routed_forward(query, key, value, is_causal, causal_alignment);
  return cuda::attention_packs_query_heads(f.params);
}

// Query rows a block of the flash forward covers on these inputs (64 or 128; 0: not the flash forward).
int64_t forward_block_m(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool is_causal,
                        int64_t causal_alignment) {
  const AttentionForward f = routed_forward(query, key, value, is_causal, causal_alignment);
  return cuda::attention_forward_block_m(f.params);
}

void set_sm_count(int64_t count) {
  TORCH_CHECK(count > 0, "set_sm_count: ", count, "; use a positive count");
  simt_emulator::sm_count = static_cast<int>(count);
}

void set_preview(bool enabled) { cuda::set_attention_preview(enabled); }

bool preview_enabled() { return cuda::attention_preview_enabled(); }

void set_arch(int64_t arch) {
  TORCH_CHECK(simt_emulator::select_arch(static_cast<int>(arch)), "set_arch: no emulated device sm_", arch,
              "; use 75, 80 or 90");
}

void set_cp_async_order(const std::string& order) {
  TORCH_CHECK(order == "late" || order == "early", "set_cp_async_order: '", order, "'; use 'late' or 'early'");
  simt_emulator::copies_land_early = order == "early";
}

void set_schedule(const std::string& order) {
  TORCH_CHECK(order == "ascending" || order == "descending", "set_schedule: '", order,
              "'; use 'ascending' or 'descending'");
  simt_emulator::schedule = order == "ascending" ? simt_emulator::Schedule::kAscending
                                                 : simt_emulator::Schedule::kDescending;
}

}  // namespace

// emulator_selftest.cpp
std::string emulator_selftest(const std::string& name);
at::Tensor emulator_mma_product(const at::Tensor& a, const at::Tensor& b, bool b_k_major);

TORCH_LIBRARY(attn_export_emu, m) {
  m.def("forward(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, Tensor? key_padding_mask, "
        "bool is_causal, float? scale, bool need_weights, float softcap=0.0, int causal_alignment=0, int window=0, "
        "float[]? alibi_slopes=None) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("backward(Tensor grad_output, Tensor? grad_weights, Tensor query, Tensor key, Tensor value, "
        "Tensor logsumexp, Tensor? attn_mask, Tensor? key_padding_mask, bool is_causal, float? scale, "
        "float softcap=0.0, int causal_alignment=0, int window=0, float[]? alibi_slopes=None) -> (Tensor, Tensor, Tensor)");
  m.def("uses_tensor_cores(Tensor query, Tensor key, Tensor value) -> bool");
  m.def("forward_workspace_size(Tensor query, Tensor key, Tensor value, bool is_causal, int causal_alignment) -> int");
  m.def("packs_query_heads(Tensor query, Tensor key, Tensor value, bool is_causal, int causal_alignment) -> bool");
  m.def("forward_block_m(Tensor query, Tensor key, Tensor value, bool is_causal, int causal_alignment) -> int");
  m.def("set_sm_count(int count) -> ()", &set_sm_count);
  m.def("set_preview(bool enabled) -> ()", &set_preview);
  m.def("preview_enabled() -> bool", &preview_enabled);
  m.def("set_arch(int arch) -> ()", &set_arch);
  m.def("set_cp_async_order(str order) -> ()", &set_cp_async_order);
  m.def("set_schedule(str order) -> ()", &set_schedule);
  m.def("selftest(str name) -> str", &emulator_selftest);
  m.def("mma_product(Tensor a, Tensor b, bool b_k_major) -> Tensor", &emulator_mma_product);
}

TORCH_LIBRARY_IMPL(attn_export_emu, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}

TORCH_LIBRARY_IMPL(attn_export_emu, CompositeExplicitAutograd, m) {
  m.impl("uses_tensor_cores", &uses_tensor_cores);
  m.impl("forward_workspace_size", &forward_workspace_size);
  m.impl("packs_query_heads", &packs_query_heads);
  m.impl("forward_block_m", &forward_block_m);
}

}  // namespace attn_export::ops
