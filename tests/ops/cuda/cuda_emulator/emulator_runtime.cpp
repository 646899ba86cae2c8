// The CUDA runtime calls the kernels' host code makes, answered on the host for the SIMT
// emulator (see simt_emulator.h): memory is ordinary (guarded) host memory, the device is the
// emulated one selected with simt_emulator::select_arch (sm_90 by default), and errors are the
// emulator's (simt_emulator::fail).
#include "simt_emulator.h"

extern "C" {

cudaError_t cudaGetDevice(int* device) {
  *device = simt_emulator::current_device.load();
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= simt_emulator::kDeviceCount) {
    return cudaErrorInvalidDevice;
  }
  const simt_emulator::Device& d = simt_emulator::kDevices[device];
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor: *value = d.major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = d.minor; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(d.smem_optin); return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(simt_emulator::kDefaultSmemLimit); return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock: *value = static_cast<int>(simt_emulator::kMaxThreadsPerBlock); return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = simt_emulator::sm_count.load(); return cudaSuccess;
    default:
      simt_emulator::fail(cudaErrorInvalidValue, "cudaDeviceGetAttribute: attribute ", static_cast<int>(attr),
                          " is not emulated");
      return cudaErrorInvalidValue;
  }
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) {
    simt_emulator::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: attribute ", static_cast<int>(attr),
                        " is not emulated");
    return cudaErrorInvalidValue;
  }
  return simt_emulator::set_max_dynamic_smem(func, value);
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t /*stream*/) {
  if (count > 0 && !guarded_memory::in_bounds(ptr, count)) {
    simt_emulator::fail(cudaErrorIllegalAddress, "cudaMemsetAsync of ", count, " bytes at ", ptr,
                        " outside every global buffer");
    return cudaErrorInvalidValue;
  }
  std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) { return simt_emulator::take_pending_error(); }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorIllegalInstruction: return "an illegal instruction was encountered";
    default: return "error (SIMT emulator)";
  }
}

// -fsanitize=alignment (build.py) calls this for every typed load or store whose address is not
// a multiple of its type's alignment: on a GPU such an access faults (misaligned address).
// The layout is UBSan's ABI (TypeMismatchData, "v1": the alignment as a log2).
struct UbsanSourceLocation {
  const char* file;
  uint32_t line, column;
};
struct UbsanTypeMismatchData {
  UbsanSourceLocation location;
  const void* type;
  unsigned char log_alignment;
  unsigned char type_check_kind;
};

void __ubsan_handle_type_mismatch_v1(void* raw_data, void* raw_pointer) {
  const auto* data = static_cast<const UbsanTypeMismatchData*>(raw_data);
  const auto pointer = reinterpret_cast<uintptr_t>(raw_pointer);
  const uintptr_t alignment = uintptr_t{1} << data->log_alignment;
  if (pointer % alignment != 0) {
    simt_emulator::fail(cudaErrorMisalignedAddress, "misaligned ", alignment, "-byte access to 0x", std::hex, pointer,
                        std::dec, " at ", data->location.file, ":", data->location.line,
                        simt_emulator::self != nullptr ? " in " + simt_emulator::where() : std::string());
  }
}

}  // extern "C"
