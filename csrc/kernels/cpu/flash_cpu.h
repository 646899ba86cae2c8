// The flash-style CPU attention core: key blocks sized for the caches, an online softmax,
// scale/soft-cap/masks/softmax fused per block, and a backward that recomputes each block from
// q, k and the saved log-sum-exp. Memory is O(block) per thread whatever the sequence lengths.
//
// It covers the calls that return no attention weights (the common case); run_attention_forward
// / run_attention_backward (attention_cpu.h) try it first and fall back to the row kernels of
// attention_cpu.cpp for the rest (need_weights, gradients of the weights, a
// backward without the forward's output).
#pragma once

#include "../../attention_params.h"

namespace attn_export::cpu::flash {

// Runs the flash forward and returns true, or returns false without touching anything when the
// call is not one it covers (p.weights requested, dtype other than float32 / float64).
bool forward(const AttentionParams& p);

// Likewise for the backward: false with p.grad_weights given, or without p.out (the
// forward's output, for the row term rowsum(dO * O) of the softmax backward).
bool backward(const AttentionBackwardParams& p);

// The instruction set the float32 kernels run with: "avx512", "avx2" or "generic". Chosen once
// from the CPU's features; ATTN_EXPORT_CPU_ISA=avx2|generic forces a lower one (tests run every
// path the machine can).
const char* isa();

}  // namespace attn_export::cpu::flash
