// What the CPU kernels take from their host instead of implementing it: a thread pool and a
// BLAS. Declared here with plain types only, so that nothing under csrc/kernels/ includes a
// framework header (tests/ops/cuda/test_cuda_build.py checks). The PyTorch extension defines these with
// ATen's (csrc/ops/cpu/runtime_aten.cpp: at::parallel_for, at::get_num_threads, and addmm_ on
// the blocks wrapped as tensors, i.e. the BLAS torch was built with); another program that
// links the kernels defines its own. A link-time seam rather than function pointers in the
// params: the params stay plain data, and the kernels' calls cost what they cost before.
#pragma once

#include <cstdint>
#include <functional>

namespace attn_export::cpu {

// How many threads parallel_for may run on.
int64_t num_threads();

// Calls fn(chunk_begin, chunk_end) on disjoint chunks that cover [begin, end), each of at
// least `grain` indices (the last may be shorter), possibly on several threads; returns when
// every chunk is done.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

// C[m, n] = alpha * op(A) op(B) + beta * C on row-major blocks with unit column strides, where
// op(A) is A [m, k] (rows lda apart) or, with trans_a, the transpose of A [k, m]; likewise
// op(B) of B [k, n] or, with trans_b, of B [n, k]. beta == 0: C's old values are not read.
void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void blas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
               int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

}  // namespace attn_export::cpu
