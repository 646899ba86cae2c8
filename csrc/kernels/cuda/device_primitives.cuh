// The few warp-level hardware primitives the flash kernels use, in one place: tensor-core MMA
// (mma.sync m16n8k16), shared-memory fragment loads (ldmatrix), asynchronous global->shared
// copies (cp.async), the fast exp2, and the dynamic shared-memory base.
//
// Everything else in the kernels is ordinary CUDA C++. Keeping the inline PTX behind these
// functions is what lets tests/ops/cuda/cuda_emulator/ run the very same kernel sources on a CPU: when
// ATTN_EXPORT_SIMT_EMULATOR is defined, the emulator's header supplies host implementations of
// exactly these functions (and of threadIdx, __syncthreads, __shfl_xor_sync, atomicAdd, kernel
// launches), each written from the PTX ISA's definition of the instruction.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16", f16/bf16 inputs, f32 accumulators);
// g = lane / 4, t = lane % 4:
//   A (16x16, row-major), 4 x b32 registers, each holding 2 elements (low half = lower column):
//     reg0: (row g,   cols 2t, 2t+1)   reg1: (row g+8, cols 2t, 2t+1)
//     reg2: (row g,   cols 2t+8, +9)   reg3: (row g+8, cols 2t+8, +9)
//   B (16x8, "col" = stored as 8 rows of n, each 16 k long), 2 x b32:
//     reg0: (k 2t, 2t+1; col g)        reg1: (k 2t+8, 2t+9; col g)
//   C/D (16x8, f32), 4 floats:
//     c0, c1: (row g, cols 2t, 2t+1)   c2, c3: (row g+8, cols 2t, 2t+1)
// ldmatrix.x4 reads four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i,
// and register i of lane L receives matrix i's (row L/4, cols 2(L%4), 2(L%4)+1) — or, with
// .trans, its (rows 2(L%4), 2(L%4)+1; col L/4). Those are exactly A/B fragments, which is why
// the kernels load every MMA operand with it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(ATTN_EXPORT_SIMT_EMULATOR)
// The emulator's header, force-included into every translation unit, defines these.
#else

namespace attn_export::cuda::device {

// The block's dynamic shared memory. One untyped declaration: declaring `extern __shared__`
// arrays of different types in different template instances is ill-formed.
template <typename T>
__device__ __forceinline__ T* shared_memory() {
  extern __shared__ __align__(16) unsigned char attn_export_smem[];
  return reinterpret_cast<T*>(attn_export_smem);
}

// 16 bytes global -> shared without staging through registers (sm_80+). When `valid` is false
// nothing is read and the 16 destination bytes are zero-filled (src-size 0): how tiles past the
// end of a sequence become zeros.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed groups are still in flight. Other threads'
// copies become visible only after a __syncthreads() that follows the wait.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// acc += A * B for one 16x8x16 tile, float accumulators.
template <typename Element>
__device__ __forceinline__ void mma_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  static_assert(std::is_same_v<Element, __half> || std::is_same_v<Element, __nv_bfloat16>);
  if constexpr (std::is_same_v<Element, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// 2^x with the SFU (ex2.approx: ~2 ulp, ex2(-inf) = +0). The flash kernels keep scores in the
// log2 domain so that each probability costs one of these and one FMA.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace attn_export::cuda::device

#endif  // ATTN_EXPORT_SIMT_EMULATOR
