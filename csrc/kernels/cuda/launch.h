// Kernel launch, the only place that uses the <<<...>>> syntax: the SIMT emulator of
// tests/ops/cuda/cuda_emulator/ replaces it to run the same kernels on a CPU.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

namespace attn_export::cuda {

// Shared memory a block may use without opting in with cudaFuncSetAttribute.
inline constexpr size_t kDefaultSmemLimit = 48 * 1024;

template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                          cudaStream_t stream, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) {
    return cudaSuccess;  // nothing to do (an empty grid is a launch error, not a no-op)
  }
  // The opt-in runs under the SIMT emulator too, which enforces the 48 KB default like a GPU.
  if (smem_bytes > kDefaultSmemLimit) {
    const cudaError_t err = cudaFuncSetAttribute(
        reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
    if (err != cudaSuccess) {
      return err;
    }
  }
#if defined(ATTN_EXPORT_SIMT_EMULATOR)
  (void)stream;
  simt_emulator::launch(kernel, grid, block, smem_bytes, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
#endif
  return cudaGetLastError();
}

}  // namespace attn_export::cuda
