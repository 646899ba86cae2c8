// A host-side SIMT emulator for the CUDA kernels of csrc/kernels/cuda/: it runs the very same
// kernel sources on a CPU, one std::thread per CUDA thread, so that their indexing, masking,
// online softmax, tiling, synchronization and fragment bookkeeping can be tested on a machine
// without a GPU (tests/test_cuda_emulator.py). It is test code only; nothing in the library
// depends on it.
//
// What it models, each from the CUDA programming guide / PTX ISA definition:
//   threadIdx/blockIdx/blockDim/gridDim; __syncthreads (a barrier over the block's threads);
//   __shfl_xor_sync (a warp-wide exchange); atomicAdd (std::atomic_ref);
//   mma.sync.m16n8k16 (f16/bf16 -> f32) from the documented A/B/C fragment layouts;
//   ldmatrix.x4 (.trans) from the documented per-lane row addresses and fragments;
//   cp.async with commit/wait groups: copies are deferred until a wait_group makes them
//   complete, so a kernel that reads shared memory before waiting sees stale data, and
//   zero-fill when the source size is 0; dynamic shared memory, one buffer per block.
//   With ATTN_EXPORT_EMU_CP_ASYNC=both in the environment, each copy is also written when
//   issued: under ThreadSanitizer that exposes the opposite bug, a refill issued while other
//   warps still read the buffer (on hardware the copy may land at once).
// What it cannot show: performance, register pressure, bank conflicts, the exact rounding
// of the hardware's MMA accumulation order and of ex2.approx, or PTX that fails to assemble
// (the nvcc compile checks cover that).
//
// Include it first in every translation unit that compiles kernel sources, with
// ATTN_EXPORT_SIMT_EMULATOR defined.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

// CUDA's host_defines.h gives these attribute meanings a host compiler ignores with warnings.
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace simt_emulator {

struct Index {
  unsigned x = 0, y = 0, z = 0;
};

constexpr int kSlotWords = 8;  // per-lane exchange space, in 64-bit words

// State shared by the threads of one block.
struct Block {
  explicit Block(unsigned threads, size_t smem_bytes)
      : barrier(threads), smem((smem_bytes + 15) / 16 + 1) {
    const unsigned warps = (threads + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned lanes = (w + 1) * 32 <= threads ? 32 : threads - w * 32;
      warp_barriers.push_back(std::make_unique<std::barrier<>>(lanes));
    }
    slots.resize(warps);
  }
  std::barrier<> barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  // Two sets of exchange slots per warp, used alternately (see warp_collective).
  std::vector<std::array<std::array<std::array<uint64_t, kSlotWords>, 32>, 2>> slots;
  struct alignas(16) Chunk {
    unsigned char bytes[16];
  };
  std::vector<Chunk> smem;
};

inline thread_local Index thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* current_block = nullptr;

inline int lane() { return static_cast<int>(thread_idx.x % 32); }
inline int warp() { return static_cast<int>(thread_idx.x / 32); }

inline thread_local unsigned collectives = 0;  // warp collectives this thread has taken part in

// A warp-collective step: every lane publishes `words`, waits for the whole warp, then runs
// `compute` on all lanes' words. Consecutive collectives alternate between two slot sets: a
// lane can only write set s again after the next collective's barrier, which every lane
// reaches only once done reading set s — so one barrier per collective suffices.
template <typename Compute>
void warp_collective(const uint64_t* words, int count, Compute&& compute) {
  Block& b = *current_block;
  auto& slots = b.slots[warp()][collectives++ % 2];
  std::memcpy(slots[lane()].data(), words, sizeof(uint64_t) * count);
  b.warp_barriers[warp()]->arrive_and_wait();
  compute(slots);
}

// Runs kernel<<<grid, block, smem>>>(args...) to completion; up to kConcurrentBlocks blocks at
// once, so that atomics from different blocks really race.
constexpr unsigned kConcurrentBlocks = 3;

template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, Args&&... args) {
  const unsigned threads = block.x * block.y * block.z;
  std::vector<Index> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back({x, y, z});
  for (size_t first = 0; first < blocks.size(); first += kConcurrentBlocks) {
    const size_t last = std::min(blocks.size(), first + kConcurrentBlocks);
    std::vector<std::unique_ptr<Block>> states;
    std::vector<std::thread> pool;
    for (size_t i = first; i < last; ++i) {
      states.push_back(std::make_unique<Block>(threads, smem_bytes));
      Block* state = states.back().get();
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([=, &args...] {
          thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
          block_idx = blocks[i];
          block_dim = {block.x, block.y, block.z};
          grid_dim = {grid.x, grid.y, grid.z};
          current_block = state;
          kernel(args...);
        });
      }
    }
    for (std::thread& t : pool) t.join();
  }
}

// ---- cp.async: per-thread groups of deferred 16-byte copies.
struct PendingCopy {
  void* dst;
  const void* src;
  bool valid;
};
inline thread_local std::vector<PendingCopy> open_group;
inline thread_local std::deque<std::vector<PendingCopy>> committed_groups;

inline void copy(const PendingCopy& c) {
  if (c.valid) {
    std::memcpy(c.dst, c.src, 16);
  } else {
    std::memset(c.dst, 0, 16);
  }
}

inline void complete(const std::vector<PendingCopy>& group) {
  for (const PendingCopy& c : group) copy(c);
}

inline bool copy_when_issued() {
  static const bool both = [] {
    const char* policy = std::getenv("ATTN_EXPORT_EMU_CP_ASYNC");
    return policy != nullptr && std::strcmp(policy, "both") == 0;
  }();
  return both;
}

inline float bits_to_float(uint16_t bits, bool is_bf16) {
  if (is_bf16) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof(f));
    return f;
  }
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

inline uint16_t half_of(uint32_t reg, int which) { return static_cast<uint16_t>(reg >> (16 * which)); }

}  // namespace simt_emulator

#define threadIdx (::simt_emulator::thread_idx)
#define blockIdx (::simt_emulator::block_idx)
#define blockDim (::simt_emulator::block_dim)
#define gridDim (::simt_emulator::grid_dim)

inline void __syncthreads() { simt_emulator::current_block->barrier.arrive_and_wait(); }

template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  uint64_t word = 0;
  std::memcpy(&word, &value, sizeof(T));
  T result{};
  simt_emulator::warp_collective(&word, 1, [&](const auto& slots) {
    std::memcpy(&result, slots[simt_emulator::lane() ^ lane_mask].data(), sizeof(T));
  });
  return result;
}

inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value);
}
inline double atomicAdd(double* address, double value) {
  return std::atomic_ref<double>(*address).fetch_add(value);
}

// The primitives of csrc/kernels/cuda/device_primitives.cuh.
namespace attn_export::cuda::device {

template <typename T>
inline T* shared_memory() {
  return reinterpret_cast<T*>(simt_emulator::current_block->smem.data());
}

inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  simt_emulator::open_group.push_back({smem_dst, gmem_src, valid});
  if (simt_emulator::copy_when_issued()) {
    simt_emulator::copy(simt_emulator::open_group.back());
  }
}

inline void cp_async_commit() {
  simt_emulator::committed_groups.push_back(std::move(simt_emulator::open_group));
  simt_emulator::open_group.clear();
}

template <int N>
inline void cp_async_wait() {
  while (simt_emulator::committed_groups.size() > static_cast<size_t>(N)) {
    simt_emulator::complete(simt_emulator::committed_groups.front());
    simt_emulator::committed_groups.pop_front();
  }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane 8i + r gives the address of row r of
// matrix i; register i of lane L receives matrix i's (row L/4, cols 2(L%4), 2(L%4)+1), or
// with .trans its (rows 2(L%4), 2(L%4)+1; col L/4). The lower-indexed element is the low half.
inline void ldmatrix_x4_impl(uint32_t (&r)[4], const void* smem_row, bool trans) {
  const uint64_t address = reinterpret_cast<uintptr_t>(smem_row);
  simt_emulator::warp_collective(&address, 1, [&](const auto& slots) {
    const int lane = simt_emulator::lane(), g = lane / 4, t = lane % 4;
    auto element = [&](int matrix, int row, int col) {
      const auto* row_ptr = reinterpret_cast<const uint16_t*>(static_cast<uintptr_t>(slots[8 * matrix + row][0]));
      return static_cast<uint32_t>(row_ptr[col]);
    };
    for (int i = 0; i < 4; ++i) {
      r[i] = trans ? element(i, 2 * t, g) | (element(i, 2 * t + 1, g) << 16)
                   : element(i, g, 2 * t) | (element(i, g, 2 * t + 1) << 16);
    }
  });
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) { ldmatrix_x4_impl(r, smem_row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) { ldmatrix_x4_impl(r, smem_row, true); }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A (16x16) * B (16x8) + C, fragments
// (g = lane / 4, t = lane % 4): A reg0 (g, 2t..), reg1 (g+8, 2t..), reg2 (g, 2t+8..),
// reg3 (g+8, 2t+8..); B reg0 (k 2t.., n g), reg1 (k 2t+8.., n g); C c0,c1 (g, 2t..),
// c2,c3 (g+8, 2t..).
template <typename Element>
inline void mma_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  const uint64_t words[3] = {a[0] | (static_cast<uint64_t>(a[1]) << 32), a[2] | (static_cast<uint64_t>(a[3]) << 32),
                             b0 | (static_cast<uint64_t>(b1) << 32)};
  simt_emulator::warp_collective(words, 3, [&](const auto& slots) {
    auto reg = [&](int lane, int index) {  // index 0..3: A regs, 4..5: B regs
      const uint64_t w = slots[lane][index / 2];
      return static_cast<uint32_t>(w >> (32 * (index % 2)));
    };
    auto A = [&](int row, int k) {
      const int lane = (row % 8) * 4 + (k % 8) / 2;
      const int index = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
      return simt_emulator::bits_to_float(simt_emulator::half_of(reg(lane, index), k % 2), kBf16);
    };
    auto B = [&](int k, int n) {
      const int lane = n * 4 + (k % 8) / 2;
      const int index = 4 + (k >= 8 ? 1 : 0);
      return simt_emulator::bits_to_float(simt_emulator::half_of(reg(lane, index), k % 2), kBf16);
    };
    const int lane = simt_emulator::lane(), g = lane / 4, t = lane % 4;
    float out[4];
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i / 2) * 8, col = 2 * t + (i % 2);
      float sum = acc[i];
      for (int k = 0; k < 16; ++k) {
        sum += A(row, k) * B(k, col);  // products of 16-bit values are exact in float
      }
      out[i] = sum;
    }
    for (int i = 0; i < 4; ++i) acc[i] = out[i];
  });
}

inline float fast_exp2(float x) { return std::exp2(x); }

}  // namespace attn_export::cuda::device
