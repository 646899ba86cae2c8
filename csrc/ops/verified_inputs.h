// The CUDA kernels' inputs for a call, rewritten so that it runs only on paths verified on a GPU
// when the preview switch is off (csrc/kernels/cuda/dispatch_policy.h): same results, verified
// code, some memory.
//   - grouped-query heads (key/value with fewer heads than query): key and value expanded to
//     every query head (one copy each); the backward's per-query-head dK/dV buffers are summed
//     back per group by kv_grad as always, so the gradients keep the key's shape.
//   - the bottom-right causal alignment with seqlen_q != seqlen_k: one query row sees every key
//     (the decode step: not causal at all); otherwise the diagonal becomes a [Lq, Lk] boolean
//     mask merged into the attention mask (or'd into a bool one, -inf into a floating one), and
//     causality is turned off. With seqlen_q == seqlen_k both alignments are the same (top-left).
//   - ALiBi slopes: the bias -slope[h] * |i + Lk - Lq - j| becomes a float32 [B or 1, H, Lq, Lk]
//     attention mask (-inf where a bool mask hid a key, added to a floating one), the slopes dropped.
// With the preview switch on, the inputs pass unchanged. The CUDA binding and the emulator's
// test ops (tests/ops/cuda/cuda_emulator/emulator_ops.cpp) both call this; the CPU kernels never do.
#pragma once

#include <ATen/ATen.h>

#include "core_args.h"

namespace attn_export::ops {

struct KernelInputs {
  at::Tensor key, value;
  CoreOptions options;
};

KernelInputs verified_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const CoreOptions& options, bool preview);

// The forward's arguments rewritten as above, after the checks of the caller's own inputs (so that
// a bad input is refused with its own shapes, not the rewritten ones).
ForwardArgs verified_forward_args(const ForwardArgs& args, bool preview);

}  // namespace attn_export::ops
