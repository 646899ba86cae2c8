// CPU kernels of the attention core, callable from any binding: the PyTorch ops
// (csrc/ops/cpu/attention_cpu_binding.cpp, and the layer's csrc/ops/cpu/
// multi_head_attention_cpu_binding.cpp, which fills AttentionParams over its projection
// buffers) or a plain C++ program that defines runtime.h.
//
// Like csrc/kernels/cuda/, nothing here includes a framework header: the kernels see raw
// pointers, element strides and sizes through AttentionParams, and take threads and BLAS
// from runtime.h.
#pragma once

#include "../../attention_params.h"

namespace attn_export::cpu {

// Runs the kernels on `p` and returns true, or returns false without touching anything when
// p.dtype is not kFloat32 / kFloat64 (callers convert half types); additive masks must have
// p.dtype too.
bool run_attention_forward(const AttentionParams& p);
bool run_attention_backward(const AttentionBackwardParams& p);

}  // namespace attn_export::cpu
