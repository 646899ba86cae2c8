// The machine's float32 multiply-add ceiling, measured: what `python -m benchmarks.run --core`
// divides the core's achieved GFLOP/s by, so that a run says how far from this CPU's limit the
// kernels are rather than only how they compare with other libraries (docs/benchmarks.md).
// Built by benchmarks/probes.py beside the installed _C, which it links: the shipped library
// carries no measurement code.
//
// Each thread runs a loop of independent fused multiply-adds on registers only, 12 accumulators
// (more than the FMA units x their latency on every x86 core since Haswell, so the loop is bound
// by FMA throughput and nothing else), in the vector width the flash core runs with
// (flash::isa()). Inline assembly, not intrinsics: a compiler may reorder, merge or spill such a
// loop, and the probe must execute exactly the instructions it counts.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/flash_cpu.h"  // flash::isa(), from _C
#include "kernels/cpu/runtime.h"    // parallel_for, from _C

namespace attn_export::cpu {
namespace {

// Iterations per timed block: 12 FMAs each, a few milliseconds on any current core.
constexpr int64_t kIterations = 1 << 20;

#if defined(__GNUC__) && defined(__x86_64__)
#define ATTN_EXPORT_FMA12(REG)                                                                     \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "2\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "3\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "4\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "5\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "6\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "7\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "8\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "9\n\t"                                             \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "10\n\t"                                            \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "11\n\t"                                            \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "12\n\t"                                            \
  "vfmadd231ps %%" REG "0, %%" REG "1, %%" REG "13\n\t"

// Zeroed operands: the accumulators stay 0, never denormal (which some cores run slowly).
__attribute__((target("avx2,fma"))) void fma_loop_avx2(int64_t iterations) {
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "1:\n\t" ATTN_EXPORT_FMA12("ymm") "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iterations)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
}

__attribute__((target("avx512f"))) void fma_loop_avx512(int64_t iterations) {
  asm volatile(
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"
      "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"
      "1:\n\t" ATTN_EXPORT_FMA12("zmm") "dec %0\n\t"
      "jnz 1b\n\t"
      : "+r"(iterations)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "cc");
}
#undef ATTN_EXPORT_FMA12
#endif

// float32 lanes per vector of the loop that runs here, 0 when there is none (the generic
// kernels have no fused multiply-add to measure).
int lanes() {
  const char* isa = flash::isa();
  return std::strcmp(isa, "avx512") == 0 ? 16 : std::strcmp(isa, "avx2") == 0 ? 8 : 0;
}

// GFLOP/s of `threads` threads of the host's pool together (0 where nothing is measured).
double fma_peak_gflops(int64_t threads, double seconds) {
#if defined(__GNUC__) && defined(__x86_64__)
  const int width = lanes();
  if (width == 0 || threads < 1) {
    return 0.0;
  }
  auto loop = width == 16 ? fma_loop_avx512 : fma_loop_avx2;
  // Best of repeated blocks: on a shared machine a block can only lose time to other work.
  loop(kIterations / 8);  // warm-up: the vector units of some cores power up on first use
  double best = 0.0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  do {
    const auto start = std::chrono::steady_clock::now();
    parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        loop(kIterations);
      }
    });
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double flops = static_cast<double>(threads) * kIterations * 12 * width * 2;
    best = std::max(best, flops / elapsed * 1e-9);
  } while (std::chrono::steady_clock::now() < deadline);
  return best;
#else
  (void)threads;
  (void)seconds;
  return 0.0;
#endif
}

}  // namespace
}  // namespace attn_export::cpu

// For benchmarks/core.py (ctypes): the peak over `threads` threads of the host's pool.
extern "C" __attribute__((visibility("default"))) double attn_export_fma_peak_gflops(int64_t threads,
                                                                                     double seconds) {
  return attn_export::cpu::fma_peak_gflops(threads, seconds);
}
