// The highest instruction set the CPU kernels may use: ATTN_EXPORT_CPU_ISA=avx2|generic lowers
// it, so that one machine can test every code path it can run (tests/ops/cpu/test_instruction_sets.py).
// Every kernel that picks an instruction set from the CPU's features caps its pick with this
// limit, so a lowered run runs no code of a higher set anywhere. A limit never raises the
// level: code for a set the CPU lacks would crash.
#pragma once

#include <cstdlib>
#include <cstring>

namespace attn_export::cpu {

enum class IsaLevel { generic = 0, avx2 = 1, avx512 = 2 };

// Read once per process; an unset or unknown value sets no limit.
inline IsaLevel isa_limit() {
  static const IsaLevel limit = [] {
    const char* forced = std::getenv("ATTN_EXPORT_CPU_ISA");
    if (forced != nullptr && std::strcmp(forced, "generic") == 0) {
      return IsaLevel::generic;
    }
    if (forced != nullptr && std::strcmp(forced, "avx2") == 0) {
      return IsaLevel::avx2;
    }
    return IsaLevel::avx512;
  }();
  return limit;
}

}  // namespace attn_export::cpu
