// CUDA kernels of the attention core, callable from any binding: the PyTorch op
// (csrc/ops/cuda/attention_cuda_binding.cu), the TensorRT plugin, or a plain C++ test.
//
// Nothing here (or anywhere under csrc/kernels/) includes torch or TensorRT headers: the
// kernels see raw pointers, element strides and sizes through AttentionParams, and run on
// the stream they are given. Memory is never allocated here; the backward's scratch space
// is a caller-provided workspace whose size attention_backward_workspace_size() reports.
//
// Every entry point returns a cudaError_t instead of throwing, so that a binding can turn
// it into its own error convention (TORCH_CHECK, a TensorRT status) and no exception ever
// crosses a library boundary.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "../../attention_params.h"

namespace attn_export::cuda {

// nullptr when the kernels accept `params`, otherwise a sentence saying why not
// (unsupported dtype, head dim above kMaxHeadDim, grid limits, mask dtype).
const char* attention_params_error(const AttentionParams& params);

// The largest head_dim / head_dim_v the kernels handle (the generic path's register tiles).
inline constexpr int kMaxHeadDim = 512;

// True when these params run the flash (tensor-core) kernels on the current device: float16
// or bfloat16; head_dim and head_dim_v multiples of 8, at most 256 (run on the smallest
// compiled size >= both, kFlashHeadDims in kernel_traits.h, the padding masked); every row of
// q, k, v and out (and, in the backward, grad_out, grad_k, grad_v) 16-byte aligned: base
// pointer, batch, head and row strides all multiples of 8 elements; sm_80 or newer.
// Everything else runs the generic kernels (same semantics, CUDA cores, any head dim).
bool attention_uses_tensor_cores(const AttentionParams& params);

// out, lse (and weights when params.weights != nullptr) from q, k, v and the masks.
// Semantics are those documented in attention_params.h.
cudaError_t run_attention_forward(const AttentionParams& params, cudaStream_t stream);

// Bytes of scratch memory run_attention_backward needs for these params (zero-initialization
// is not required: the backward clears what it needs on `stream`).
size_t attention_backward_workspace_size(const AttentionBackwardParams& params);

// grad_q, grad_k, grad_v. Reads q, k, v, lse and the masks like the forward, grad_out and
// grad_weights, and also params.out: the forward's output, from which the backward gets
// rowsum(dO * O) (FlashAttention-2's "D" term) without materializing any Lq x Lk matrix.
// `workspace` must hold attention_backward_workspace_size(params) bytes, 256-byte aligned.
cudaError_t run_attention_backward(const AttentionBackwardParams& params, void* workspace,
                                   cudaStream_t stream);

}  // namespace attn_export::cuda
