// The CPU attention kernels, for callers that fill AttentionParams themselves (the layer's
// CPU implementation runs the core straight on its projection buffers).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../../attention_params.h"

namespace attn_export::ops::cpu {

// p.dtype must be kFloat32 or kFloat64 (half types are converted by the caller); additive
// masks must have p.dtype too.
void run_attention_forward(const AttentionParams& p);
void run_attention_backward(const AttentionBackwardParams& p);

// Masks prepared for the kernels: a floating mask converted to `dtype`; the attention mask
// broadcast to [B, H, Lq, Lk].
std::optional<at::Tensor> kernel_attn_mask(const std::optional<at::Tensor>& mask, int64_t batch,
                                           int64_t heads, at::ScalarType dtype);
std::optional<at::Tensor> kernel_padding_mask(const std::optional<at::Tensor>& mask, at::ScalarType dtype);

}  // namespace attn_export::ops::cpu
