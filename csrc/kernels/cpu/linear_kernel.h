// The layer's projections on few tokens: C[m, n] = A[m, k] B[k, n] + bias[n] in float32
// (and, from block_gemm.h, the attention core's larger blocks).
//
// Why not BLAS: at the sizes of short sequences (a few hundred tokens, embed dims of a few
// hundred) MKL's threaded sgemm spends a third to a half of its time on its own thread
// hand-off and per-call setup; the projections then cost more than the rest of the layer
// together. One register-blocked tile loop (AVX-512, or AVX2 with FMA), with the token rows
// (or, for a handful of tokens, the column panels) split once across threads, runs them at
// close to the single-core rate on every core (docs/benchmarks.md). Anything it does not
// cover (other dtypes, CPUs without AVX2/FMA, large products where BLAS is at its best) goes
// to the GEMM library of gemm_backend.h.
#pragma once

#include <cstdint>

namespace attn_export::cpu {

// Columns per panel of B: the tile width, and the unit a column split should use.
constexpr int64_t kLinearPanelCols = 32;

// Up to this many token rows against a row-major weight, linear_rows takes a dot-product loop
// that packs nothing (measured: at 32 rows packing is as fast).
constexpr int64_t kLinearDotMaxRows = 16;

// The tile loop this CPU runs: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL), else AVX2 + FMA, capped by
// ATTN_EXPORT_CPU_ISA (isa_limit.h).
enum class LinearKernelIsa { none, avx2, avx512 };
LinearKernelIsa linear_kernel_isa();

// The largest product (m * n * k multiply-adds) the layer's projections give the tile loop
// when the GEMM backend chooses (projection.cpp); the library takes the larger ones. Measured
// at 2 threads on an AMD Zen 3 CPU with AVX2 (docs/benchmarks.md, "CPU GEMMs"):
//   - behind OpenBLAS (the automatic library on AMD), 2^23: the tile loop kept up with it on
//     the 8x16x128x4 layer's 2e6-6e6, and OpenBLAS led by 10-60% from 1.7e7 up (measured
//     with both splitting rows; splitting columns below as many rows as features, as both do
//     now, sped both up alike at 64-128 tokens);
//   - behind MKL on AMD with AVX2 (and no AVX-512), 2^31: 1.0-1.4x MKL's rate from 1.3e8 to
//     1.6e9, MKL ahead at 3.2e9 (4096 x 1536 x 512);
//   - elsewhere 2^25, not measured against the library.
int64_t linear_kernel_max_work();

// Whether linear_rows may run: the CPU has one of its ISAs and the GEMM backend in force
// allows it (gemm_backend.h: a forced library turns it off).
bool linear_kernel_available();

struct LinearArgs {
  int64_t m, n, k;
  const float* a;     // [m, k], rows lda apart, unit column stride
  int64_t lda;
  const float* b;     // [k, n], rows ldb apart, unit column stride (a weight W[n, k] stored column-major);
  int64_t ldb;        // with b_transposed: W[n, k] itself, rows ldb apart (nn.Linear's row-major layout)
  const float* bias;  // [n] or nullptr
  float* c;           // [m, n], rows ldc apart
  int64_t ldc;
  bool accumulate = false;  // C += A B (+ bias) instead of C = A B (+ bias)
  bool b_transposed = false;  // b holds B^T = W row-major: every panel is packed (transposed) first
};

// Rows [row_begin, row_end) and columns [col_begin, col_end) of C, on the calling thread.
// scratch: linear_scratch_floats(k) floats. Only call when linear_kernel_available().
void linear_rows(const LinearArgs& args, int64_t row_begin, int64_t row_end, int64_t col_begin,
                 int64_t col_end, float* scratch);

int64_t linear_scratch_floats(int64_t k);

}  // namespace attn_export::cpu
