// Tensor -> AttentionParams: the one place where the ATen world meets the kernels' plain-data
// seam. Shared by every device's binding so that shape checks and messages are identical.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "../attention_params.h"
#include "core_args.h"

namespace attn_export::ops {

// Validates the attention core's inputs; the messages quote the shapes received. The Python
// fake kernels (exporter/attn_export/ops/fake.py) raise the same messages.
void check_attention_inputs(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask);

// The mask part of check_attention_inputs, for callers without 4-D q/k/v tensors.
void check_attention_masks(
    int64_t batch,
    int64_t heads,
    int64_t seqlen_q,
    int64_t seqlen_k,
    at::Device device,
    const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask);

// A mask as the kernels read it: `mask` is the [B, H, Lq, Lk] view from broadcast_attn_mask,
// or a [B, Lk] key-padding mask.
AttentionMask mask_params(const at::Tensor& mask, bool is_key_padding);

// Validates the backward's own inputs against the forward's (already checked) ones; the
// messages quote the shapes received, and the fake kernel raises the same.
void check_attention_backward_inputs(
    const at::Tensor& grad_output,
    const at::Tensor& logsumexp,
    const at::Tensor& query,
    const at::Tensor& value);

// 1/sqrt(head_dim) unless given.
double resolve_scale(std::optional<double> scale, int64_t head_dim);

// Checks each trailing attribute (ATTN_EXPORT_TRAILING_ATTRIBUTES) against its range in the spec
// (csrc/attention_spec.h kAttributeRanges): "attention: <name> must be <rule>; got <value>".
// The fake kernels raise the same message.
void check_core_attributes(const CoreOptions& options);

// The ALiBi slopes, when given and not empty: one per query head (num_heads of them), each finite
// in float32. "attention: alibi_slopes must ...; got ...; <the fix>"; the fake kernels raise the same.
void check_alibi_slopes(const CoreOptions& options, int64_t num_heads);

// The options' ALiBi slopes as the kernels read them: a float32 [num_heads] tensor on `like`'s
// device (AttentionParams::alibi_slopes points at it); nullopt when ALiBi is off (no slopes, or none).
std::optional<at::Tensor> kernel_alibi_slopes(const CoreOptions& options, const at::Tensor& like);

// An attention mask as a [B, H, Lq, Lk] view (broadcast dims get stride 0). Accepts
// nn.MultiheadAttention's 3-D [B*H, Lq, Lk] and any mask broadcastable to [B, H, Lq, Lk] (the
// masks F.scaled_dot_product_attention takes); check_attention_masks has refused the rest.
at::Tensor broadcast_attn_mask(const at::Tensor& mask, int64_t batch, int64_t heads, int64_t seqlen_q,
                               int64_t seqlen_k);

// A [batch, heads, seqlen, dim] tensor whose memory is token-major, [batch, seqlen, heads, dim]:
// the layout of every [B, H, L, D] result of the kernels. Merging the heads back into
// [batch * seqlen, heads * dim] for an output projection is then a view, not a copy. The layout
// is fixed (not derived from the inputs' strides) so that fake kernels can state it exactly.
at::Tensor empty_token_major(int64_t batch, int64_t heads, int64_t seqlen, int64_t dim,
                             at::TensorOptions options);

// The gradient of a [B, H, L, D] input: contiguous where the input is, token-major otherwise.
// Gradients in the input's own layout let autograd keep them as a leaf's .grad as they are;
// token-major gradients of contiguous leaves cost a strided copy each (AccumulateGrad, 1.1 ms per
// [1, 4, 1024, 64] float32 gradient on one thread). The rule reads contiguity only, so that the
// fake kernel states the same layout exactly (_fake.empty_grad_like).
at::Tensor empty_grad_like(const at::Tensor& input, at::TensorOptions options);

// The buffer the kernels write dK or dV into for `input` (key or value): per query head,
// [B, heads, Lk, *] (attention_params.h), so the gradient itself when input has `heads` heads,
// else a token-major buffer that kv_grad folds.
at::Tensor empty_kernel_kv_grad(const at::Tensor& input, int64_t heads, at::TensorOptions options);

// The gradient of `input` (key or value) from the kernels' per-query-head buffer: each group's
// query heads summed, in empty_grad_like's layout.
at::Tensor kv_grad(const at::Tensor& kernel_grad, const at::Tensor& input);

// Floating dtype in which a kernel accumulates: float32 for float16/bfloat16/float32, float64 for float64.
at::ScalarType accumulation_dtype(at::ScalarType dtype);

DataType to_data_type(at::ScalarType dtype);

// Points one [B, H, L, D] slot of the params (pointer and three leading strides) at a tensor.
template <typename Ptr>
void point_at(Ptr& ptr, int64_t& batch_stride, int64_t& head_stride, int64_t& row_stride, const at::Tensor& t) {
  ptr = t.data_ptr();
  batch_stride = t.stride(0);
  head_stride = t.stride(1);
  row_stride = t.stride(2);
}

// An operand as the kernels read it: converted to `dtype` when given (and different), and with
// its last dim contiguous (other strides are free).
at::Tensor kernel_operand(const at::Tensor& t, std::optional<at::ScalarType> dtype = std::nullopt);

// Masks as the kernels read them: the attention mask broadcast to [B, H, Lq, Lk]
// (broadcast_attn_mask); with `dtype`, a floating mask converted to it (bool masks stay bool:
// the kernels read them as bytes).
std::optional<at::Tensor> kernel_attn_mask(const std::optional<at::Tensor>& mask, int64_t batch,
                                           int64_t heads, int64_t seqlen_q, int64_t seqlen_k,
                                           std::optional<at::ScalarType> dtype = std::nullopt);
std::optional<at::Tensor> kernel_padding_mask(const std::optional<at::Tensor>& mask,
                                              std::optional<at::ScalarType> dtype = std::nullopt);

// Fills shapes, q/k/v/out strides, masks and the options (scale resolved, causality, soft-cap,
// and whatever else CoreOptions carries). The masks come as the kernels read them:
// `attn_mask4d` from broadcast_attn_mask, `key_padding_mask` from kernel_padding_mask (the
// options' own masks are not read), and so do the ALiBi slopes (kernel_alibi_slopes; required
// when the options have slopes: the params never drop them). Every tensor's last dim must be
// contiguous.
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
    const std::optional<at::Tensor>& alibi_slopes = std::nullopt);

// A forward pass of the attention core set up for a device's kernels: the inputs checked,
// q/k/v converted to `compute_dtype` (the dtype the kernels read and write: the accumulation
// dtype on the CPU, the inputs' own on CUDA), out allocated token-major in it, lse and (with
// need_weights) weights in the accumulation dtype, and the params pointing at all of them. The
// tensors keep the params' memory alive. Every device binding (and the CUDA emulator's test
// ops) starts its forward here.
struct AttentionForward {
  at::Tensor q, k, v, out, lse;
  std::optional<at::Tensor> weights, attn_mask, key_padding_mask, alibi_slopes;
  AttentionParams params;
};

// masks_in_compute_dtype: floating masks converted to compute_dtype too (the CPU kernels read
// masks in their own dtype; the CUDA kernels read any floating dtype).
AttentionForward prepare_attention_forward(const ForwardArgs& args, at::ScalarType compute_dtype,
                                           bool masks_in_compute_dtype);

// The _attention_forward op's results (output, logsumexp, weights) after the kernels ran:
// output and weights in the query's dtype, weights an empty tensor when not computed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_forward_results(const AttentionForward& forward,
                                                                         const at::Tensor& query);

// The backward's params: `forward` (from make_attention_params: q, k, v, lse, masks, scale,
// causality, and `out` = the forward's output for the kernels that read it) plus the incoming
// gradients and the gradient outputs. `grad_weights`, when given, must already be broadcast to
// [B, H, Lq, Lk] in the accumulation dtype with its last dim contiguous.
AttentionBackwardParams make_attention_backward_params(
    const AttentionParams& forward,
    const at::Tensor& grad_out,
    const std::optional<at::Tensor>& grad_weights,
    const at::Tensor& grad_q,
    const at::Tensor& grad_k,
    const at::Tensor& grad_v);

}  // namespace attn_export::ops
