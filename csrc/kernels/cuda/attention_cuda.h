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
// (unsupported dtype, head dim above kMaxHeadDim, grid limits, mask dtype; without the preview
// switch, grouped-query heads and a shifted causal diagonal, which wait for a GPU: see below).
const char* attention_params_error(const AttentionParams& params);

// The preview switch (dispatch_policy.h): whether the paths not yet verified on a GPU may run
// (further flash head dims, grouped-query heads in the kernels, the bottom-right causal
// alignment, split-KV decoding). Read once from ATTN_EXPORT_CUDA_PREVIEW ("1" = on) unless
// set_attention_preview() was called; set_attention_preview overrides it for the process (tests,
// hosts with their own configuration).
bool attention_preview_enabled();
void set_attention_preview(bool enabled);

// The largest head_dim / head_dim_v the kernels handle (the generic path's register tiles).
inline constexpr int kMaxHeadDim = 512;

// True when these params run the flash (tensor-core) kernels on the current device: float16
// or bfloat16; head_dim and head_dim_v multiples of 8, at most 256 (run on the smallest
// compiled size >= both, kFlashHeadDims in kernel_traits.h, the padding masked); every row of
// q, k, v and out (and, in the backward, grad_out, grad_k, grad_v) 16-byte aligned: base
// pointer, batch, head and row strides all multiples of 8 elements; sm_80 or newer.
// Everything else runs the generic kernels (same semantics, CUDA cores, any head dim).
bool attention_uses_tensor_cores(const AttentionParams& params);

// True when the flash forward packs the query heads of each key/value head into its tiles'
// rows (grouped-query decode; dispatch_policy.h pack_gqa, preview only) for these params.
bool attention_packs_query_heads(const AttentionParams& params);

// Query rows a block of the sm80 flash forward covers for these params on the current device
// (forward_plan.h: 64, or 128 for prefill under the preview, dispatch_policy.h
// wide_forward_tiles); 0 when the flash forward does not run them.
int attention_forward_block_m(const AttentionParams& params);

// Bytes of scratch memory the forward can use for these params on the current device: the
// split-KV partial results (split_kv.h) when the preview switch is on and the query tiles
// cannot fill the GPU; 0 otherwise.
size_t attention_forward_workspace_size(const AttentionParams& params);

// An upper bound of attention_forward_workspace_size over every batch <= params.batch and
// seqlen_q <= params.seqlen_q (any seqlen_k; same heads and head dims) on the current device,
// with the preview switch on or off: what a host that sizes its workspace once for a range of
// shapes, before the switch matters (a TensorRT plugin's getWorkspaceSize), reserves.
size_t attention_forward_workspace_bound(const AttentionParams& params);

// out, lse (and weights when params.weights != nullptr) from q, k, v and the masks.
// Semantics are those documented in attention_params.h. `workspace` (256-byte aligned,
// `workspace_bytes` long, no zeroing needed) may be null: the forward then runs without
// split-KV, as it also does whenever workspace_bytes < attention_forward_workspace_size(params).
cudaError_t run_attention_forward(const AttentionParams& params, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream);

// Bytes of scratch memory run_attention_backward needs for these params (zero-initialization
// is not required: the backward clears what it needs on `stream`).
size_t attention_backward_workspace_size(const AttentionBackwardParams& params);

// Whether run_attention_backward may give different bits run to run for these params: the sm80
// flash backward adds dQ with unordered float atomics (the generic kernels and the Hopper backward
// with params.deterministic do not). Bindings alert a caller who asked for determinism.
bool attention_backward_is_nondeterministic(const AttentionBackwardParams& params);

// grad_q, grad_k, grad_v. Reads q, k, v, lse and the masks like the forward, grad_out and
// grad_weights, and also params.out: the forward's output, from which the backward gets
// rowsum(dO * O) (FlashAttention-2's "D" term) without materializing any Lq x Lk matrix.
// `workspace` must hold attention_backward_workspace_size(params) bytes, 256-byte aligned.
cudaError_t run_attention_backward(const AttentionBackwardParams& params, void* workspace,
                                   cudaStream_t stream);

}  // namespace attn_export::cuda
