// The layer's CUDA registration: the device-generic implementation of multi_head_attention.cpp,
// whose projections run on the tensors' device (cuBLAS) and whose core goes through the
// dispatcher to the CUDA attention kernels (attention_cuda_binding.cu). Compiled only into
// CUDA builds, like everything in this folder.
#include <torch/library.h>

#include "../../attention_spec.h"
#include "../multi_head_attention.h"

namespace attn_export::ops {

TORCH_LIBRARY_IMPL(attn_export, CUDA, m) {
  m.impl(spec::kOpMultiHeadAttention, &layer_kernel<multi_head_attention_forward>);
  m.impl(spec::kOpMultiHeadAttentionForward, &layer_forward_kernel<multi_head_attention_forward>);
  m.impl(spec::kOpMultiHeadAttentionBackward, &layer_backward_op<device_layer_backward<core_backward>>);
}

}  // namespace attn_export::ops
