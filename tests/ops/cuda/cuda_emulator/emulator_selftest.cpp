// Small kernels that check the emulator itself (tests/ops/cuda/test_cuda_emulator.py): each selftest case
// does one thing a GPU refuses or faults on (or its legal twin) and returns the emulator's error
// message, "" when there was none; mma_product multiplies one 16x16 by one 16x8 matrix the way
// the flash kernels do (ldmatrix fragments into mma.sync), to cross-check the fragment tables
// against a product whose answer is known.
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>

#include "guarded_memory_scope.h"
#include "simt_emulator.h"

namespace attn_export::ops {
namespace {

using namespace attn_export::cuda::device;

void write_shared(int offset) {
  if (threadIdx.x == 0) {
    shared_memory<unsigned char>()[offset] = 1;
  }
}

void write_global(float* p, int index) {
  if (threadIdx.x == 0) {
    p[index] = 1.f;
  }
}

void copy_async(const unsigned char* src) {
  cp_async_16(shared_memory<unsigned char>() + 16 * threadIdx.x, src + 16 * threadIdx.x, true);
  cp_async_commit();
  cp_async_wait<0>();
}

void load_matrix(int offset) {
  uint32_t r[4];
  ldmatrix_x4(r, shared_memory<unsigned char>() + 16 * (threadIdx.x % 32) + offset);
}

void shuffle(unsigned mask, float* out) {
  const float v = __shfl_xor_sync(mask, static_cast<float>(threadIdx.x), 1);
  if (threadIdx.x == 0) {
    *out = v;
  }
}

void diverge() {
  if (threadIdx.x % 32 < 16) {
    __shfl_xor_sync(0xffffffffu, 1.f, 1);
  } else {
    uint32_t r[4];
    ldmatrix_x4(r, shared_memory<unsigned char>());
  }
}

// A 4-byte store of a half pair, as the flash kernels' epilogue does: 4-byte alignment needed.
__attribute__((noinline)) void store_pair(unsigned char* p) { *reinterpret_cast<uint32_t*>(p) = 0x3c003c00u; }
void store_pair_kernel(unsigned char* p) {
  if (threadIdx.x == 0) {
    store_pair(p);
  }
}

void noop() {}

// Thread 0 leaves before the barrier the others wait at.
void skip_barrier() {
  if (threadIdx.x == 0) {
    return;
  }
  __syncthreads();
}

// Half a warp executes a full-mask shuffle.
void shuffle_in_branch(float* out) {
  if (threadIdx.x % 32 < 16) {
    *out = __shfl_xor_sync(0xffffffffu, 1.f, 1);
  }
}

// Thread t writes its shared-memory slot, then reads the slot of thread t + 32 (the other warp),
// with or without the barrier between: without, the warp that runs first reads the other's
// slot before it is written (the poison of fresh shared memory) in either schedule.
void exchange(bool sync, float* out) {
  float* s = shared_memory<float>();
  s[threadIdx.x] = static_cast<float>(threadIdx.x);
  if (sync) {
    __syncthreads();
  }
  out[threadIdx.x] = s[(threadIdx.x + 32) % 64];
}
void check_exchange(const float* out) {
  for (int t = 0; t < 64; ++t) {
    if (out[t] != static_cast<float>((t + 32) % 64)) {
      simt_emulator::fail(cudaErrorUnknown, "thread ", t, " read ", out[t], " for the slot of thread ", (t + 32) % 64);
      return;
    }
  }
}

// The whole case: a launch, then cudaGetLastError as launch_kernel does.
std::string run(const std::function<void()>& body) {
  simt_emulator::reset_errors();
  body();
  const cudaError_t err = cudaGetLastError();
  const std::string detail = simt_emulator::first_error();
  return err == cudaSuccess && detail.empty() ? "" : std::string(cudaGetErrorString(err)) + ": " + detail;
}

const void* key(void (*kernel)(int)) { return reinterpret_cast<const void*>(kernel); }

// Tile loads as the kernels issue them: A rows for lanes 0-15 / 16-31 at columns 0 / 8, and B
// either stored [n][k] (the "col" operand, plain ldmatrix) or [k][n] (ldmatrix .trans).
template <typename Element>
void mma_kernel(const Element* a, const Element* b, bool b_k_major, float* d) {
  Element* sA = shared_memory<Element>();  // [16][16]
  Element* sB = sA + 16 * 16;              // [8][16] or [16][8]
  const int lane = threadIdx.x;
  for (int i = lane; i < 16 * 16; i += 32) sA[i] = a[i];
  for (int i = lane; i < 16 * 8; i += 32) sB[i] = b[i];
  __syncthreads();
  uint32_t ra[4], rb[4];
  ldmatrix_x4(ra, sA + (lane % 16) * 16 + (lane / 16) * 8);
  if (b_k_major) {
    ldmatrix_x4_trans(rb, sB + (lane % 16) * 8);
  } else {
    ldmatrix_x4(rb, sB + (lane % 8) * 16 + ((lane / 8) % 2) * 8);
  }
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  mma_16816<Element>(acc, ra, rb[0], rb[1]);
  const int g = lane / 4, t = lane % 4;
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

}  // namespace

std::string emulator_selftest(const std::string& name) {
  using simt_emulator::launch;
  guarded_memory::Scope guarded;
  at::Tensor buffer = at::zeros({64}, at::kFloat);  // 256 bytes, guarded
  auto* bytes = static_cast<unsigned char*>(buffer.data_ptr());
  at::Tensor out = at::zeros({1}, at::kFloat);
  const std::map<std::string, std::function<void()>> cases = {
      {"threads_1024", [] { launch(noop, dim3(1), dim3(1024), 0); }},
      {"threads_1025", [] { launch(noop, dim3(1), dim3(1025), 0); }},
      {"block_z_65", [] { launch(noop, dim3(1), dim3(1, 1, 65), 0); }},
      {"grid_y_65536", [] { launch(noop, dim3(1, 65536), dim3(1), 0); }},
      {"smem_48k", [] { launch(write_shared, dim3(1), dim3(1), 48 * 1024, 0); }},
      {"smem_48k_plus_1", [] { launch(write_shared, dim3(1), dim3(1), 48 * 1024 + 1, 0); }},
      {"smem_100k_opted_in",
       [] {
         if (cudaFuncSetAttribute(key(write_shared), cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024) ==
             cudaSuccess) {
           launch(write_shared, dim3(1), dim3(1), 100 * 1024, 0);
         }
       }},
      {"smem_200k_opted_in",
       [] {
         if (cudaFuncSetAttribute(key(write_shared), cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024) ==
             cudaSuccess) {
           launch(write_shared, dim3(1), dim3(1), 200 * 1024, 0);
         }
       }},
      {"smem_write_last", [] { launch(write_shared, dim3(1), dim3(1), 64, 63); }},
      {"smem_write_past_end", [] { launch(write_shared, dim3(1), dim3(1), 64, 64); }},
      {"smem_write_before_start", [] { launch(write_shared, dim3(1), dim3(1), 64, -1); }},
      {"global_write_last", [&] { launch(write_global, dim3(1), dim3(1), 0, buffer.data_ptr<float>(), 63); }},
      {"global_write_past_end", [&] { launch(write_global, dim3(1), dim3(1), 0, buffer.data_ptr<float>(), 64); }},
      {"cp_async_in_bounds", [&] { launch(copy_async, dim3(1), dim3(16), 256, static_cast<const unsigned char*>(bytes)); }},
      {"cp_async_past_end",
       [&] { launch(copy_async, dim3(1), dim3(16), 256, static_cast<const unsigned char*>(bytes + 16)); }},
      {"cp_async_misaligned",
       [&] { launch(copy_async, dim3(1), dim3(8), 256, static_cast<const unsigned char*>(bytes + 8)); }},
      {"cp_async_smem_overflow",
       [&] { launch(copy_async, dim3(1), dim3(16), 240, static_cast<const unsigned char*>(bytes)); }},
      {"ldmatrix_aligned", [] { launch(load_matrix, dim3(1), dim3(32), 512, 0); }},
      {"ldmatrix_misaligned", [] { launch(load_matrix, dim3(1), dim3(32), 512, 2); }},
      {"ldmatrix_past_end", [] { launch(load_matrix, dim3(1), dim3(32), 512 - 16, 0); }},
      {"ldmatrix_partial_warp", [] { launch(load_matrix, dim3(1), dim3(16), 512, 0); }},
      {"shfl_full_mask", [&] { launch(shuffle, dim3(1), dim3(32), 0, 0xffffffffu, out.data_ptr<float>()); }},
      {"shfl_half_mask", [&] { launch(shuffle, dim3(1), dim3(32), 0, 0x0000ffffu, out.data_ptr<float>()); }},
      {"shfl_mask_of_partial_warp", [&] { launch(shuffle, dim3(1), dim3(16), 0, 0x0000ffffu, out.data_ptr<float>()); }},
      {"shfl_mask_beyond_partial_warp",
       [&] { launch(shuffle, dim3(1), dim3(16), 0, 0xffffffffu, out.data_ptr<float>()); }},
      {"divergent_collectives", [] { launch(diverge, dim3(1), dim3(32), 64); }},
      {"barrier_skipped", [] { launch(skip_barrier, dim3(1), dim3(64), 0); }},
      {"shfl_in_half_a_warp", [&] { launch(shuffle_in_branch, dim3(1), dim3(32), 0, out.data_ptr<float>()); }},
      {"exchange_synced",
       [&] {
         launch(exchange, dim3(1), dim3(64), 256, true, buffer.data_ptr<float>());
         check_exchange(buffer.data_ptr<float>());
       }},
      {"exchange_unsynced",
       [&] {
         launch(exchange, dim3(1), dim3(64), 256, false, buffer.data_ptr<float>());
         check_exchange(buffer.data_ptr<float>());
       }},
      {"store_pair_aligned", [&] { launch(store_pair_kernel, dim3(1), dim3(1), 0, bytes + 4); }},
      {"store_pair_misaligned", [&] { launch(store_pair_kernel, dim3(1), dim3(1), 0, bytes + 2); }},
  };
  const auto it = cases.find(name);
  TORCH_CHECK(it != cases.end(), "selftest: no case '", name, "'");
  return run(it->second);
}

at::Tensor emulator_mma_product(const at::Tensor& a, const at::Tensor& b, bool b_k_major) {
  TORCH_CHECK(a.sizes() == at::IntArrayRef({16, 16}), "mma_product: a must be 16 x 16");
  TORCH_CHECK(b.sizes() == (b_k_major ? at::IntArrayRef({16, 8}) : at::IntArrayRef({8, 16})),
              "mma_product: b must be 16 x 8 (k-major) or 8 x 16 (n-major)");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16),
              "mma_product: float16 or bfloat16 operands of one dtype");
  guarded_memory::Scope guarded;
  const at::Tensor ga = guarded_memory::guarded_copy(a.contiguous()), gb = guarded_memory::guarded_copy(b.contiguous());
  at::Tensor d = at::empty({16, 8}, a.options().dtype(at::kFloat));
  const std::string error = run([&] {
    if (a.scalar_type() == at::kHalf) {
      simt_emulator::launch(mma_kernel<__half>, dim3(1), dim3(32), 2 * (16 * 16 + 16 * 8),
                            static_cast<const __half*>(ga.data_ptr()), static_cast<const __half*>(gb.data_ptr()),
                            b_k_major, d.data_ptr<float>());
    } else {
      simt_emulator::launch(mma_kernel<__nv_bfloat16>, dim3(1), dim3(32), 2 * (16 * 16 + 16 * 8),
                            static_cast<const __nv_bfloat16*>(ga.data_ptr()),
                            static_cast<const __nv_bfloat16*>(gb.data_ptr()), b_k_major, d.data_ptr<float>());
    }
  });
  TORCH_CHECK(error.empty(), "mma_product: ", error);
  return d;
}

}  // namespace attn_export::ops
