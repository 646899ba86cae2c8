// The GEMM backend switch of gemm_backend.h and the OpenBLAS it may load.
#include "gemm_backend.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <mutex>

namespace attn_export::cpu {
namespace {

// CBLAS enum values (cblas.h): fixed by the CBLAS standard, so no header is needed.
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;

using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                         float*, int);
using DgemmFn = void (*)(int, int, int, int, int, int, double, const double*, int, const double*, int, double,
                         double*, int);
using SetThreadsFn = void (*)(int);
using ConfigFn = char* (*)();

struct OpenBlas {
  SgemmFn sgemm = nullptr;
  DgemmFn dgemm = nullptr;
  SetThreadsFn set_num_threads = nullptr;
  ConfigFn get_config = nullptr;
};

// Written once under the mutex, before `loaded` is published; read without locking after.
OpenBlas openblas;
std::atomic<bool> loaded{false};
std::mutex load_mutex;

std::atomic<GemmBackend> backend{GemmBackend::aten};
std::atomic<bool> microkernels{true};

template <typename Fn>
bool find(void* handle, const char* name, Fn* fn, std::string* error) {
  *fn = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*fn == nullptr) {
    *error = std::string("it has no symbol ") + name + " (not a scipy-openblas build?)";
  }
  return *fn != nullptr;
}

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: the CBLAS row-major entry
// does that swap itself, so the blocks pass through as they are.
template <typename T, typename Fn>
void gemm(Fn fn, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha,
          const T* a, int64_t lda, const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  fn(kCblasRowMajor, trans_a ? kCblasTrans : kCblasNoTrans, trans_b ? kCblasTrans : kCblasNoTrans,
     static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
     static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

}  // namespace

const char* gemm_backend_name(GemmBackend b) {
  switch (b) {
    case GemmBackend::aten: return "aten";
    case GemmBackend::openblas: return "openblas";
    case GemmBackend::microkernel: return "microkernel";
  }
  return "?";
}

GemmBackend gemm_backend() {
  return backend.load(std::memory_order_relaxed);
}

bool gemm_microkernels_enabled() {
  return microkernels.load(std::memory_order_relaxed);
}

void set_gemm_backend(GemmBackend b, bool use_microkernels) {
  backend.store(b, std::memory_order_relaxed);
  microkernels.store(use_microkernels, std::memory_order_relaxed);
}

bool load_openblas(const std::string& path, std::string* error) {
  std::lock_guard<std::mutex> lock(load_mutex);
  if (loaded.load()) {
    return true;
  }
  // RTLD_LOCAL: its symbols stay out of the global namespace, where they could not clash
  // anyway (the scipy_ prefix), and nothing else binds to them by accident.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    *error = "dlopen(" + path + ") failed: " + (why != nullptr ? why : "unknown error");
    return false;
  }
  OpenBlas api;
  std::string missing;
  if (!find(handle, "scipy_cblas_sgemm", &api.sgemm, &missing) ||
      !find(handle, "scipy_cblas_dgemm", &api.dgemm, &missing) ||
      !find(handle, "scipy_openblas_set_num_threads", &api.set_num_threads, &missing) ||
      !find(handle, "scipy_openblas_get_config", &api.get_config, &missing)) {
    *error = path + ": " + missing;
    dlclose(handle);
    return false;
  }
  // One thread, for good: the callers split the work between their own threads (runtime.h's
  // parallel_for), and a second pool on the same cores would fight the first.
  api.set_num_threads(1);
  openblas = api;  // the handle stays open for the life of the process
  loaded.store(true);
  return true;
}

bool openblas_loaded() {
  return loaded.load();
}

std::string openblas_config() {
  return openblas_loaded() ? std::string(openblas.get_config()) : std::string();
}

void openblas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                   const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  gemm(openblas.sgemm, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void openblas_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                   const double* a, int64_t lda, const double* b, int64_t ldb, double beta, double* c,
                   int64_t ldc) {
  gemm(openblas.dgemm, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace attn_export::cpu

// The switch as attn_export/ops/gemm.py drives it, through ctypes on the loaded _C library: a C
// interface keeps these controls out of the operator schemas (torch.ops), which describe math.
extern "C" {

// backend: 0 aten, 1 openblas, 2 microkernel (GemmBackend's order). Returns 0, or -1 when
// openblas is asked for but was not loaded.
__attribute__((visibility("default"))) int attn_export_gemm_set(int backend, int microkernels) {
  using attn_export::cpu::GemmBackend;
  const GemmBackend b = static_cast<GemmBackend>(backend);
  if (b == GemmBackend::openblas && !attn_export::cpu::openblas_loaded()) {
    return -1;
  }
  attn_export::cpu::set_gemm_backend(b, microkernels != 0);
  return 0;
}

// Returns 0, or -1 with the reason in error[0:error_size).
__attribute__((visibility("default"))) int attn_export_gemm_load_openblas(const char* path, char* error,
                                                                          int error_size) {
  std::string why;
  if (attn_export::cpu::load_openblas(path, &why)) {
    return 0;
  }
  std::snprintf(error, static_cast<size_t>(error_size), "%s", why.c_str());
  return -1;
}

// OpenBLAS's openblas_get_config() ("" when not loaded) into config[0:size).
__attribute__((visibility("default"))) void attn_export_gemm_openblas_config(char* config, int size) {
  std::snprintf(config, static_cast<size_t>(size), "%s", attn_export::cpu::openblas_config().c_str());
}

// The CPU's vendor as the GEMM choice sees it: 1 AMD, 2 Intel, 0 other.
__attribute__((visibility("default"))) int attn_export_cpu_vendor() {
#if defined(__GNUC__) && defined(__x86_64__)
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? 1 : __builtin_cpu_is("intel") ? 2 : 0;
#else
  return 0;
#endif
}

}  // extern "C"
