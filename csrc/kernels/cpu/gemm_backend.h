// Which library runs the CPU layer's GEMMs (the projections, their gradients, and the
// attention core's blocks through runtime.h's blas_gemm), chosen once per process:
//
//   aten         the BLAS PyTorch was built with (MKL on x86 wheels), through at::addmm / at::mm
//   openblas     OpenBLAS from the `scipy-openblas32` wheel, loaded with dlopen from the path
//                attn_export/ops/gemm.py finds: the build needs neither its headers nor its
//                library, and a machine without the wheel still runs (on `aten`)
//   microkernel  the project's register-tiled kernels (linear_kernel.h) for every float32
//                product they cover, `aten` for the rest (float64, odd strides)
//
// Under `aten` and `openblas` the float32 products small enough for linear_kernel.h still go
// to it when the CPU has its ISA (AVX-512, or AVX2 with FMA): a library call costs
// microseconds of dispatch and packing there (linear_kernel.h). set_gemm_backend's
// `microkernels` switch turns that off, so that a forced library really runs every product.
//
// Plain types only: nothing under csrc/kernels/ includes a framework header.
#pragma once

#include <cstdint>
#include <string>

namespace attn_export::cpu {

enum class GemmBackend { aten, openblas, microkernel };

// Below this many multiply-adds per thread a product runs on one thread: a second thread costs
// more to wake than it saves (the split of the micro-kernels' and OpenBLAS's products).
constexpr int64_t kGemmMinWorkPerThread = int64_t{1} << 17;

const char* gemm_backend_name(GemmBackend backend);

// The backend in force, and whether small float32 products go to linear_kernel.h.
GemmBackend gemm_backend();
bool gemm_microkernels_enabled();

// Puts a backend in force. `openblas` needs load_openblas to have succeeded.
void set_gemm_backend(GemmBackend backend, bool microkernels);

// dlopen()s an OpenBLAS built with scipy-openblas's `scipy_` symbol prefix. On failure returns
// false and says why in *error; the backend in force does not change.
bool load_openblas(const std::string& path, std::string* error);
bool openblas_loaded();
// OpenBLAS's description of itself: its version, build options and the kernel set (core) it
// picked for this CPU, e.g. "OpenBLAS 0.3.30 DYNAMIC_ARCH NO_AFFINITY Zen MAX_THREADS=64".
std::string openblas_config();

// C[m, n] = alpha * op(A) op(B) + beta * C through OpenBLAS on the calling thread, with
// runtime.h's blas_gemm conventions (row-major blocks, unit column strides). Only call when
// openblas_loaded().
void openblas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void openblas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                   const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
                   int64_t ldc);

}  // namespace attn_export::cpu
