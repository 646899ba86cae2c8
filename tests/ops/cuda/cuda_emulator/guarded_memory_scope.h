// The torch side of guarded_memory.h, for the emulated ops (emulator_ops.cpp).
#pragma once

#include <ATen/ATen.h>

#include "guarded_memory.h"

namespace guarded_memory {

// While alive, CPU tensors are allocated between guard zones (not thread-safe against other
// threads allocating tensors; the emulated ops run one at a time).
class Scope {
 public:
  Scope();
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  c10::Allocator* previous_;
};

// `t` with the same sizes, strides, storage offset and dtype, its storage copied into a guarded
// buffer (call inside a Scope). Undefined stays undefined.
at::Tensor guarded_copy(const at::Tensor& t);

}  // namespace guarded_memory
