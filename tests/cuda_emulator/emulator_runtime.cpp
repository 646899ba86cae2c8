// The CUDA runtime calls the kernels' host code makes, answered on the host for the SIMT
// emulator (see simt_emulator.h): memory is ordinary host memory, the "device" is one sm_90.
#include "simt_emulator.h"

extern "C" {

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int /*device*/) {
  *value = attr == cudaDevAttrComputeCapabilityMajor ? 9 : 0;
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t /*stream*/) {
  std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) { return cudaSuccess; }

const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : "error (SIMT emulator)";
}

}  // extern "C"
