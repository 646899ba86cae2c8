// Guard zones around global memory for the SIMT emulator (simt_emulator.h): while an emulated op
// runs, every CPU tensor it allocates (outputs, workspaces, and the copies of its inputs) comes
// from an allocator that puts 256 bytes of guard on each side of the buffer and fills buffer and
// guards with 0xFF bytes (NaN as float16/bfloat16/float32/float64), as a GPU's fresh memory is
// garbage. A read past a buffer then yields NaN, a write past it damages a guard (checked after
// every launch), and cp.async checks its source against the live buffers. Implemented in
// guarded_memory.cpp; this header stays free of torch so the kernel units compile fast.
#pragma once

#include <cstddef>
#include <string>

namespace guarded_memory {

// [p, p + bytes) lies inside one live guarded buffer (true as well when none is tracked).
bool in_bounds(const void* p, size_t bytes);

// "" when every live buffer's guards are intact; else which buffer and where.
std::string damaged_guards();

}  // namespace guarded_memory
