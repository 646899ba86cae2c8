// A host-side SIMT emulator for the CUDA kernels of csrc/kernels/cuda/: it runs the very same
// kernel sources on a CPU, so that their indexing, masking, online softmax, tiling,
// synchronization and fragment bookkeeping can be tested on a machine without a GPU
// (tests/ops/cuda/test_cuda_emulator.py). It is test code only; nothing in the library depends on it.
//
// How the CUDA threads run: each block's threads are fibers (ucontext) on one OS thread, switched
// only where a CUDA thread waits (__syncthreads, a warp-synchronous instruction), in a fixed
// order (set_schedule): ascending runs the lowest-numbered thread that can run, so warp 0 gets
// as far as it can before warp 1 starts, and descending the reverse. A missing barrier between one
// warp's shared-memory write and another's read shows as a wrong result in one order or the
// other, the same way on every run and on a loaded machine (an OS thread per CUDA thread made
// the test suite's cost swing fourfold with the host's load). A deadlock (threads waiting at a
// barrier the others never reach) fails the launch instead of hanging. Built with
// ThreadSanitizer (tsan_check.py, test_emulator_breakage.py), every CUDA thread is an OS thread
// instead, so that TSan sees the races.
//
// What it models, each from the CUDA programming guide / PTX ISA definition:
//   threadIdx/blockIdx/blockDim/gridDim; __syncthreads (a barrier over the block's threads);
//   __shfl_xor_sync (a warp-wide exchange); atomicAdd, atomicMin/Max on int (std::atomic_ref);
//   mma.sync.m16n8k16 (f16/bf16 -> f32) and ldmatrix.x4 (.trans) from the PTX ISA's fragment
//   tables (see mma_16816 and ldmatrix_x4_impl below), not from the kernels' comments;
//   cp.async with commit/wait groups, under one of two orderings (set_cp_async_order):
//     late  (default) copies land at the wait_group that completes them, so a kernel that reads
//           shared memory before waiting sees stale data; zero-fill when the source size is 0;
//     early copies land when issued: a refill issued while other warps still read the buffer
//           overwrites what they read (on hardware the copy may land at once); under
//           ThreadSanitizer that is reported as a race.
// And it is as strict as a GPU where a GPU would fail (each failure is a cudaError_t from the
// launch plus a message saying what and where, see fail()):
//   - launch limits of the emulated device (kDevices): 1024 threads per block, block dims
//     (1024, 1024, 64), grid dims (2^31 - 1, 65535, 65535), dynamic shared memory at most 48 KB
//     unless cudaFuncSetAttribute(MaxDynamicSharedMemorySize) opted in, and never above the
//     device's opt-in maximum; the device reports the compute capability asked for;
//   - alignment: cp.async source and destination, ldmatrix row addresses (16 bytes), and every
//     typed load/store of the kernels (-fsanitize=alignment, reported by the handler in
//     emulator_runtime.cpp: a misaligned 4-byte store of a half pair fails as on a GPU);
//   - shared memory starts as NaN (0xFF bytes) between guard zones: a write outside the
//     launch's dynamic shared memory, or a cp.async/ldmatrix outside it, fails; reads of
//     uninitialized or out-of-bounds shared memory give NaN;
//   - global memory (guarded_memory.h): every tensor an emulated op touches lives between
//     guard zones and starts as NaN; a write into a guard, or a cp.async from outside any
//     buffer, fails;
//   - warp-synchronous instructions: every lane of the warp must execute the same one
//     (divergence fails); ldmatrix and mma need a full warp; a __shfl_xor_sync whose mask
//     does not name exactly the lanes executing it (or lanes disagreeing on it) fails.
//   - a deadlock: a __syncthreads or warp-synchronous instruction that some threads of the block
//     or warp never reach (an early return before a barrier, a shuffle in a branch).
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
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <ucontext.h>
#include <sys/mman.h>
#include <utility>
#include <vector>

#include "guarded_memory.h"

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

// ---- Errors: the first failure of an op is kept with its message; the launch that saw it
// returns its code (cudaGetLastError), as a GPU's launch or next synchronization would.

struct Errors {
  std::mutex mutex;
  cudaError_t pending = cudaSuccess;
  std::string first;
};
inline Errors& errors() {
  static Errors e;
  return e;
}

template <typename... Parts>
void fail(cudaError_t code, const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  Errors& e = errors();
  std::lock_guard<std::mutex> lock(e.mutex);
  if (e.pending == cudaSuccess) {
    e.pending = code;
  }
  if (e.first.empty()) {
    e.first = message.str();
  }
}

inline cudaError_t take_pending_error() {
  Errors& e = errors();
  std::lock_guard<std::mutex> lock(e.mutex);
  return std::exchange(e.pending, cudaSuccess);
}

inline std::string first_error() {
  Errors& e = errors();
  std::lock_guard<std::mutex> lock(e.mutex);
  return e.first;
}

inline void reset_errors() {
  Errors& e = errors();
  std::lock_guard<std::mutex> lock(e.mutex);
  e.pending = cudaSuccess;
  e.first.clear();
}

// ---- Emulated devices. Limits from the CUDA C++ Programming Guide, "Technical Specifications
// per Compute Capability" (identical for these three except the shared-memory opt-in).

struct Device {
  int major, minor;
  size_t smem_optin;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
};
inline constexpr Device kDevices[] = {{7, 5, 64 * 1024}, {8, 0, 163 * 1024}, {9, 0, 227 * 1024}};
inline constexpr int kDeviceCount = sizeof(kDevices) / sizeof(kDevices[0]);
inline constexpr unsigned kMaxThreadsPerBlock = 1024;
inline constexpr unsigned kMaxBlockDim[3] = {1024, 1024, 64};
inline constexpr unsigned kMaxGridDim[3] = {2147483647u, 65535, 65535};
inline constexpr size_t kDefaultSmemLimit = 48 * 1024;

inline std::atomic<int> current_device{kDeviceCount - 1};
// cudaDevAttrMultiProcessorCount of every emulated device (an H200's by default); tests change it
// to steer split-KV (csrc/kernels/cuda/split_kv.h).
inline std::atomic<int> sm_count{132};

// Selects the device with compute capability major.minor = arch / 10, arch % 10; false if none.
inline bool select_arch(int arch) {
  for (int d = 0; d < kDeviceCount; ++d) {
    if (kDevices[d].major * 10 + kDevices[d].minor == arch) {
      current_device = d;
      return true;
    }
  }
  return false;
}

// cudaFuncAttributeMaxDynamicSharedMemorySize per (device, kernel), as cudaFuncSetAttribute sets it.
struct FuncAttributes {
  std::mutex mutex;
  std::map<std::pair<int, const void*>, size_t> max_dynamic_smem;
};
inline FuncAttributes& func_attributes() {
  static FuncAttributes a;
  return a;
}

inline size_t max_dynamic_smem(const void* kernel) {
  FuncAttributes& a = func_attributes();
  std::lock_guard<std::mutex> lock(a.mutex);
  const auto it = a.max_dynamic_smem.find({current_device.load(), kernel});
  return it == a.max_dynamic_smem.end() ? kDefaultSmemLimit : it->second;
}

inline cudaError_t set_max_dynamic_smem(const void* kernel, int bytes) {
  const Device& device = kDevices[current_device.load()];
  if (bytes < 0 || static_cast<size_t>(bytes) > device.smem_optin) {
    fail(cudaErrorInvalidValue, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize, ", bytes, "): above the ",
         device.smem_optin, "-byte opt-in maximum of sm_", device.major, device.minor);
    return cudaErrorInvalidValue;
  }
  FuncAttributes& a = func_attributes();
  std::lock_guard<std::mutex> lock(a.mutex);
  a.max_dynamic_smem[{current_device.load(), kernel}] = static_cast<size_t>(bytes);
  return cudaSuccess;
}

// ---- Threads, blocks, warps.

struct Index {
  unsigned x = 0, y = 0, z = 0;
};

constexpr int kSlotWords = 8;        // per-lane exchange space, in 64-bit words
constexpr int kOpWord = kSlotWords - 1;  // ... the last of which names the collective
constexpr size_t kSmemGuard = 256;   // bytes of guard on each side of a block's shared memory
constexpr unsigned char kPoison = 0xFF;  // NaN as float16, bfloat16, float32 and float64

// One 16-byte cp.async, landed at issue (early) or at the wait that completes its group (late).
struct PendingCopy {
  void* dst;
  const void* src;
  bool valid;
};

struct Block;

// What CUDA gives each thread, and its cp.async groups.
struct ThreadState {
  Index thread_idx, block_idx, block_dim, grid_dim;
  Block* block = nullptr;
  unsigned collectives = 0;  // warp collectives this thread has taken part in
  std::vector<PendingCopy> open_group;
  std::deque<std::vector<PendingCopy>> committed_groups;
};

// The CUDA thread running on this OS thread (a fiber's, or the OS thread's own under TSan).
inline thread_local ThreadState* self = nullptr;

#if defined(__SANITIZE_THREAD__)
#define SIMT_EMULATOR_FIBERS 0
#else
#define SIMT_EMULATOR_FIBERS 1
#endif

// The order in which a block's fibers run (see the top of this file).
enum class Schedule { kAscending, kDescending };
inline std::atomic<Schedule> schedule{Schedule::kAscending};

#if SIMT_EMULATOR_FIBERS
// A block's threads as fibers on the calling OS thread. A fiber runs until it waits at a
// barrier; then the scheduler resumes the first fiber in schedule order whose barrier has
// opened. When none can run and some have not finished, the block is deadlocked.
class Fibers;
inline thread_local Fibers* running_fibers = nullptr;

struct Barrier {
  explicit Barrier(unsigned count, std::string what) : count(count), what(std::move(what)) {}
  void arrive_and_wait();
  unsigned count, arrived = 0;
  uint64_t generation = 0;
  std::string what;  // for the deadlock message
};

// Fiber stacks, kept for the next launch: mapping and first touching fresh ones for every
// block cost more than the kernels' work (page faults, and the address-space lock the
// concurrent blocks' threads contend for).
class Stacks {
 public:
  static constexpr size_t kBytes = 256 * 1024;  // a guard page below each

  static void* take() {
    {
      std::lock_guard<std::mutex> lock(mutex());
      if (!free().empty()) {
        void* stack = free().back();
        free().pop_back();
        return stack;
      }
    }
    void* stack = mmap(nullptr, kBytes + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stack == MAP_FAILED) throw std::bad_alloc();
    mprotect(stack, page(), PROT_NONE);  // a stack overflow faults instead of overwriting a neighbour
    return stack;
  }
  static void give_back(void* stack) {
    std::lock_guard<std::mutex> lock(mutex());
    free().push_back(stack);
  }
  static size_t page() {
    static const size_t bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return bytes;
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<void*>& free() {
    static std::vector<void*> stacks;
    return stacks;
  }
};

class Fibers {
 public:
  Fibers(unsigned threads, std::function<void(ThreadState&)> setup, std::function<void()> body)
      : fibers_(threads), setup_(std::move(setup)), body_(std::move(body)) {
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = fibers_[t];
      f.stack = Stacks::take();
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack;
      f.context.uc_stack.ss_size = Stacks::kBytes + Stacks::page();
      f.context.uc_link = nullptr;
      makecontext(&f.context, &Fibers::entry, 0);
      setup_(f.state);
    }
  }
  ~Fibers() {
    for (Fiber& f : fibers_) Stacks::give_back(f.stack);
  }

  // Runs every fiber to its end, or until the block deadlocks (then fails the launch).
  void run() {
    running_fibers = this;
    order_ = schedule.load();
    if (const int first = next_ready(); first >= 0) switch_to(first, &main_);
    running_fibers = nullptr;
    self = nullptr;
  }

  // The running fiber waits until `barrier` opens.
  void wait(Barrier& barrier) {
    Fiber& me = fibers_[current_];
    me.waiting = &barrier;
    me.generation = barrier.generation;
    const int next = next_ready();
    if (next < 0) {
      deadlock();
      return;
    }
    switch_to(next, &me.context);
  }

 private:
  struct Fiber {
    ucontext_t context;
    void* stack = nullptr;
    ThreadState state;
    Barrier* waiting = nullptr;
    uint64_t generation = 0;
    bool done = false;
  };

  static void entry() {
    Fibers& f = *running_fibers;
    f.body_();
    f.fibers_[f.current_].done = true;
    const int next = f.next_ready();
    if (next >= 0) {
      f.switch_to(next, nullptr);
    } else if (f.all_done()) {
      setcontext(&f.main_);
    } else {
      f.deadlock();
    }
  }

  bool ready(const Fiber& f) const {
    return !f.done && (f.waiting == nullptr || f.waiting->generation != f.generation);
  }
  int next_ready() const {
    const int n = static_cast<int>(fibers_.size());
    for (int i = 0; i < n; ++i) {
      const int t = order_ == Schedule::kAscending ? i : n - 1 - i;
      if (ready(fibers_[t])) return t;
    }
    return -1;
  }
  bool all_done() const {
    for (const Fiber& f : fibers_)
      if (!f.done) return false;
    return true;
  }

  // Saves the running context into `from` (none: a finished fiber's) and resumes fiber `to`.
  void switch_to(int to, ucontext_t* from) {
    current_ = to;
    fibers_[to].waiting = nullptr;
    self = &fibers_[to].state;
    if (from != nullptr) {
      swapcontext(from, &fibers_[to].context);
    } else {
      setcontext(&fibers_[to].context);
    }
  }

  // Fails the launch naming where the block's threads wait, and abandons the block.
  void deadlock();

  std::vector<Fiber> fibers_;
  std::function<void(ThreadState&)> setup_;
  std::function<void()> body_;
  ucontext_t main_;
  int current_ = 0;
  Schedule order_ = Schedule::kAscending;
};

inline void Barrier::arrive_and_wait() {
  if (++arrived == count) {  // the last to arrive opens it and goes on
    arrived = 0;
    ++generation;
    return;
  }
  running_fibers->wait(*this);
}
#else
struct Barrier {
  Barrier(unsigned count, const std::string&) : barrier(count) {}
  void arrive_and_wait() { barrier.arrive_and_wait(); }
  std::barrier<> barrier;
};
#endif

// State shared by the threads of one block.
struct Block {
  explicit Block(unsigned threads, size_t smem_bytes)
      : barrier(threads, "__syncthreads"), smem_bytes(smem_bytes), storage((2 * kSmemGuard + smem_bytes + 15) / 16) {
    std::memset(storage.data(), kPoison, storage.size() * sizeof(Chunk));
    const unsigned warps = (threads + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned lanes = (w + 1) * 32 <= threads ? 32 : threads - w * 32;
      warp_lanes.push_back(lanes);
      warp_barriers.push_back(std::make_unique<Barrier>(lanes, "a warp-synchronous instruction of warp " + std::to_string(w)));
    }
    slots.resize(warps);
  }
  unsigned char* smem() { return reinterpret_cast<unsigned char*>(storage.data()) + kSmemGuard; }
  bool in_smem(const void* p, size_t bytes) {
    const auto* c = static_cast<const unsigned char*>(p);
    return c >= smem() && c + bytes <= smem() + smem_bytes;
  }
  // Offset of the first damaged guard byte from the start of shared memory, or 0 if intact.
  std::ptrdiff_t guard_damage() {
    const auto* all = reinterpret_cast<const unsigned char*>(storage.data());
    const size_t total = storage.size() * sizeof(Chunk);
    for (size_t i = 0; i < total; ++i) {
      const bool guard = i < kSmemGuard || i >= kSmemGuard + smem_bytes;
      if (guard && all[i] != kPoison) {
        return static_cast<std::ptrdiff_t>(i) - static_cast<std::ptrdiff_t>(kSmemGuard);
      }
    }
    return 0;
  }

  Barrier barrier;
  std::vector<unsigned> warp_lanes;
  std::vector<std::unique_ptr<Barrier>> warp_barriers;
  // Two sets of exchange slots per warp, used alternately (see warp_collective).
  std::vector<std::array<std::array<std::array<uint64_t, kSlotWords>, 32>, 2>> slots;
  size_t smem_bytes;
  struct alignas(16) Chunk {
    unsigned char bytes[16];
  };
  std::vector<Chunk> storage;  // [guard][smem_bytes][guard]
};

inline int linear_thread() {
  const ThreadState& s = *self;
  return static_cast<int>(s.thread_idx.x + s.block_dim.x * (s.thread_idx.y + s.block_dim.y * s.thread_idx.z));
}
inline int lane() { return linear_thread() % 32; }
inline int warp() { return linear_thread() / 32; }

inline std::string where() {
  std::ostringstream s;
  s << "block (" << self->block_idx.x << ", " << self->block_idx.y << ", " << self->block_idx.z << ") thread "
    << linear_thread();
  return s.str();
}

#if SIMT_EMULATOR_FIBERS
inline void Fibers::deadlock() {
  std::ostringstream waits;
  const char* sep = "";
  for (size_t t = 0; t < fibers_.size(); ++t) {
    const Fiber& f = fibers_[t];
    if (!f.done && f.waiting != nullptr) {
      waits << sep << "thread " << t << " at " << f.waiting->what;
      sep = ", ";
      if (waits.tellp() > 300) {
        waits << ", ...";
        break;
      }
    }
  }
  const Index& b = fibers_[current_].state.block_idx;
  fail(cudaErrorLaunchTimeout, "deadlock in block (", b.x, ", ", b.y, ", ", b.z,
       "): threads wait at a barrier that other threads of the block or warp never reach (", waits.str(), ")");
  setcontext(&main_);
}
#endif

// The warp-synchronous instructions, to tell them apart when lanes diverge.
enum class Collective : uint64_t { kShfl = 1, kLdmatrix, kLdmatrixTrans, kMma };
inline const char* name(Collective c) {
  switch (c) {
    case Collective::kShfl: return "__shfl_xor_sync";
    case Collective::kLdmatrix: return "ldmatrix.x4";
    case Collective::kLdmatrixTrans: return "ldmatrix.x4.trans";
    case Collective::kMma: return "mma.sync.m16n8k16";
  }
  return "?";
}

// A warp-collective step: every lane publishes `words`, waits for the whole warp, then runs
// `compute` on all lanes' words. Consecutive collectives alternate between two slot sets: a
// lane can only write set s again after the next collective's barrier, which every lane
// reaches only once done reading set s — so one barrier per collective suffices.
template <typename Compute>
void warp_collective(Collective op, const uint64_t* words, int count, Compute&& compute) {
  Block& b = *self->block;
  auto& slots = b.slots[warp()][self->collectives++ % 2];
  std::memcpy(slots[lane()].data(), words, sizeof(uint64_t) * count);
  slots[lane()][kOpWord] = static_cast<uint64_t>(op);
  b.warp_barriers[warp()]->arrive_and_wait();
  const unsigned lanes = b.warp_lanes[warp()];
  for (unsigned l = 0; l < lanes; ++l) {
    if (slots[l][kOpWord] != static_cast<uint64_t>(op)) {
      fail(cudaErrorIllegalInstruction, "warp divergence: in ", where(), " lane ", lane(), " executed ", name(op),
           " while lane ", l, " of its warp executed ", name(static_cast<Collective>(slots[l][kOpWord])));
      return;  // the other lanes' words mean something else: nothing to compute from them
    }
  }
  if (op != Collective::kShfl && lanes != 32) {
    fail(cudaErrorIllegalInstruction, name(op), " in a warp of ", lanes, " threads (", where(),
         "): .sync.aligned instructions need all 32 lanes");
  }
  compute(slots, lanes);
}

// ---- Launch: runs kernel<<<grid, block, smem>>>(args...) to completion, up to
// kConcurrentBlocks blocks at once (each on its own OS thread), so that atomics from different
// blocks really race.
constexpr unsigned kConcurrentBlocks = 3;

inline bool launch_config_ok(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes) {
  const unsigned g[3] = {grid.x, grid.y, grid.z}, b[3] = {block.x, block.y, block.z};
  const char* axis = "xyz";
  for (int i = 0; i < 3; ++i) {
    if (b[i] == 0 || b[i] > kMaxBlockDim[i]) {
      fail(cudaErrorInvalidConfiguration, "launch: blockDim.", axis[i], " = ", b[i], " (limit ", kMaxBlockDim[i], ")");
      return false;
    }
    if (g[i] > kMaxGridDim[i]) {
      fail(cudaErrorInvalidConfiguration, "launch: gridDim.", axis[i], " = ", g[i], " (limit ", kMaxGridDim[i], ")");
      return false;
    }
  }
  const size_t threads = static_cast<size_t>(b[0]) * b[1] * b[2];
  if (threads > kMaxThreadsPerBlock) {
    fail(cudaErrorInvalidConfiguration, "launch: ", threads, " threads per block (limit ", kMaxThreadsPerBlock, ")");
    return false;
  }
  const size_t limit = max_dynamic_smem(kernel);
  if (smem_bytes > limit) {
    fail(cudaErrorInvalidValue, "launch: ", smem_bytes, " bytes of dynamic shared memory, above the kernel's ",
         limit, "-byte limit",
         limit == kDefaultSmemLimit ? " (more than 48 KB needs cudaFuncSetAttribute(MaxDynamicSharedMemorySize))"
                                    : "");
    return false;
  }
  return true;
}

template <typename... KernelArgs, typename... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, Args&&... args) {
  if (!launch_config_ok(reinterpret_cast<const void*>(kernel), grid, block, smem_bytes)) {
    return;
  }
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
      auto setup = [=](ThreadState& s, unsigned t) {
        s.thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
        s.block_idx = blocks[i];
        s.block_dim = {block.x, block.y, block.z};
        s.grid_dim = {grid.x, grid.y, grid.z};
        s.block = state;
      };
#if SIMT_EMULATOR_FIBERS
      pool.emplace_back([=, &args...] {
        unsigned next = 0;
        Fibers fibers(threads, [&](ThreadState& s) { setup(s, next++); }, [&] { kernel(args...); });
        fibers.run();
      });
#else
      for (unsigned t = 0; t < threads; ++t) {
        pool.emplace_back([=, &args...] {
          ThreadState own;
          setup(own, t);
          self = &own;
          kernel(args...);
          self = nullptr;
        });
      }
#endif
    }
    for (std::thread& t : pool) t.join();
    for (size_t i = first; i < last; ++i) {
      if (const std::ptrdiff_t at = states[i - first]->guard_damage()) {
        fail(cudaErrorIllegalAddress, "shared memory written out of bounds by block (", blocks[i].x, ", ",
             blocks[i].y, ", ", blocks[i].z, "): byte ", at, " of a ", smem_bytes, "-byte allocation");
      }
    }
  }
  if (const std::string damage = guarded_memory::damaged_guards(); !damage.empty()) {
    fail(cudaErrorIllegalAddress, "global memory written out of bounds: ", damage);
  }
}

// ---- cp.async: per-thread groups of deferred 16-byte copies (ThreadState).

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

// The cp.async ordering: false = late (at the wait), true = early (when issued).
inline std::atomic<bool> copies_land_early{[] {
  const char* policy = std::getenv("ATTN_EXPORT_EMU_CP_ASYNC");
  return policy != nullptr && std::strcmp(policy, "early") == 0;
}()};

inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

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

// ---- Fragment tables of the PTX ISA, section 9.7.14.5.8 "Matrix Fragments for mma.m16n8k16
// with floating point type" (.f16/.bf16 multiplicands, .f32 accumulators). With
// groupID = %laneid >> 2 and threadID_in_group = %laneid % 4, element i of a lane's fragment
// (registers hold elements low to high: register j = elements 2j, 2j + 1) sits at:
//   A (16x16): row = groupID for a0, a1, a4, a5, else groupID + 8;
//              col = 2 * threadID_in_group + (i & 1), plus 8 for a4..a7.
//   B (16x8):  row = 2 * threadID_in_group + (i & 1), plus 8 for b2, b3;  col = groupID.
//   C/D (16x8): row = groupID for c0, c1, else groupID + 8;  col = 2 * threadID_in_group + (i & 1).
struct Position {
  int row, col;
};
inline Position a_element(int laneid, int i) {
  const int group = laneid >> 2, tig = laneid % 4;
  const bool upper_rows = !(i < 2 || (i >= 4 && i < 6));
  return {group + (upper_rows ? 8 : 0), tig * 2 + (i & 1) + (i >= 4 ? 8 : 0)};
}
inline Position b_element(int laneid, int i) {
  const int group = laneid >> 2, tig = laneid % 4;
  return {tig * 2 + (i & 1) + (i >= 2 ? 8 : 0), group};
}
inline Position c_element(int laneid, int i) {
  const int group = laneid >> 2, tig = laneid % 4;
  return {group + (i >= 2 ? 8 : 0), tig * 2 + (i & 1)};
}

// The tables inverted: which lane's fragment holds element (row, col), and where in it.
struct Holder {
  uint8_t lane, index;
};
struct Holders {
  Holder a[16][16], b[16][8];
};
inline const Holders& holders() {
  static const Holders h = [] {
    Holders t{};
    for (int laneid = 0; laneid < 32; ++laneid) {
      for (int i = 0; i < 8; ++i) {
        const Position p = a_element(laneid, i);
        t.a[p.row][p.col] = {static_cast<uint8_t>(laneid), static_cast<uint8_t>(i)};
      }
      for (int i = 0; i < 4; ++i) {
        const Position p = b_element(laneid, i);
        t.b[p.row][p.col] = {static_cast<uint8_t>(laneid), static_cast<uint8_t>(i)};
      }
    }
    return t;
  }();
  return h;
}

}  // namespace simt_emulator

#define threadIdx (::simt_emulator::self->thread_idx)
#define blockIdx (::simt_emulator::self->block_idx)
#define blockDim (::simt_emulator::self->block_dim)
#define gridDim (::simt_emulator::self->grid_dim)

inline void __syncthreads() { simt_emulator::self->block->barrier.arrive_and_wait(); }

// CUDA C++ Programming Guide, "Warp Shuffle Functions": the executing lane and the source lane
// must be in `mask`, and every lane named in it must execute the same shuffle. The emulator
// runs every lane of the warp through it, so the mask must name exactly the warp's lanes.
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  uint64_t words[2] = {0, mask};
  std::memcpy(&words[0], &value, sizeof(T));
  T result = value;
  simt_emulator::warp_collective(simt_emulator::Collective::kShfl, words, 2, [&](const auto& slots, unsigned lanes) {
    using simt_emulator::fail;
    const int me = simt_emulator::lane();
    const unsigned executing = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    for (unsigned l = 0; l < lanes; ++l) {
      if (slots[l][1] != mask) {
        fail(cudaErrorIllegalInstruction, "__shfl_xor_sync in ", simt_emulator::where(), ": mask 0x", std::hex, mask,
             " but lane ", std::dec, l, " of the warp passed 0x", std::hex, slots[l][1]);
      }
    }
    if ((mask & executing) != executing) {
      fail(cudaErrorIllegalInstruction, "__shfl_xor_sync in ", simt_emulator::where(), ": lanes 0x", std::hex,
           executing & ~mask, " execute it but are not in its mask 0x", mask);
    }
    if ((mask & ~executing) != 0) {
      fail(cudaErrorIllegalInstruction, "__shfl_xor_sync in ", simt_emulator::where(), ": mask 0x", std::hex, mask,
           " names lanes 0x", mask & ~executing, " that do not execute it");
    }
    int source = me ^ lane_mask;
    if (source / width > me / width) {
      source = me;  // a later group of `width` lanes: the own value
    }
    if (source < static_cast<int>(lanes) && ((mask >> source) & 1u)) {
      std::memcpy(&result, slots[source].data(), sizeof(T));
    }
  });
  return result;
}

inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value);
}
inline double atomicAdd(double* address, double value) {
  return std::atomic_ref<double>(*address).fetch_add(value);
}
// atomicMin / atomicMax on int (any address space): the old value, as CUDA's.
inline int atomicMin(int* address, int value) {
  std::atomic_ref<int> word(*address);
  int old = word.load();
  while (value < old && !word.compare_exchange_weak(old, value)) {
  }
  return old;
}
inline int atomicMax(int* address, int value) {
  std::atomic_ref<int> word(*address);
  int old = word.load();
  while (value > old && !word.compare_exchange_weak(old, value)) {
  }
  return old;
}

// The primitives of csrc/kernels/cuda/device_primitives.cuh.
namespace attn_export::cuda::device {

template <typename T>
inline T* shared_memory() {
  return reinterpret_cast<T*>(simt_emulator::self->block->smem());
}

// PTX ISA "cp.async": 16 bytes from .global to .shared, both addresses aligned to the copy size;
// src-size 0 reads nothing and zero-fills.
inline void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  using simt_emulator::fail;
  if (!simt_emulator::aligned(smem_dst, 16) || !simt_emulator::aligned(gmem_src, 16)) {
    fail(cudaErrorMisalignedAddress, "cp.async 16 bytes in ", simt_emulator::where(), ": destination ", smem_dst,
         " or source ", gmem_src, " not 16-byte aligned");
    return;
  }
  if (!simt_emulator::self->block->in_smem(smem_dst, 16)) {
    fail(cudaErrorIllegalAddress, "cp.async in ", simt_emulator::where(), ": destination ", smem_dst,
         " outside the block's ", simt_emulator::self->block->smem_bytes, " bytes of shared memory");
    return;
  }
  if (valid && !guarded_memory::in_bounds(gmem_src, 16)) {
    fail(cudaErrorIllegalAddress, "cp.async in ", simt_emulator::where(), ": source ", gmem_src,
         " outside every global buffer");
    return;
  }
  if (simt_emulator::copies_land_early) {
    simt_emulator::copy({smem_dst, gmem_src, valid});  // landed: nothing left for the wait
  } else {
    simt_emulator::self->open_group.push_back({smem_dst, gmem_src, valid});
  }
}

inline void cp_async_commit() {
  simt_emulator::self->committed_groups.push_back(std::move(simt_emulator::self->open_group));
  simt_emulator::self->open_group.clear();
}

template <int N>
inline void cp_async_wait() {
  while (simt_emulator::self->committed_groups.size() > static_cast<size_t>(N)) {
    simt_emulator::complete(simt_emulator::self->committed_groups.front());
    simt_emulator::self->committed_groups.pop_front();
  }
}

// PTX ISA 9.7.14.5.15 "Warp-level matrix load instruction: ldmatrix", .m8n8.x4.b16: lanes
// 8m..8m+7 give the addresses of rows 0..7 of matrix m (16-byte rows, naturally aligned, in
// shared memory); "a group of four consecutive threads loads an entire row", thread 0 receiving
// the first fragment, so destination register m of lane L holds row L >> 2 of matrix m,
// elements 2 (L % 4) (low half) and 2 (L % 4) + 1 (high half). With .trans the matrix is read
// column-major: the same lane gets column L >> 2, rows 2 (L % 4) and 2 (L % 4) + 1.
inline void ldmatrix_x4_impl(uint32_t (&r)[4], const void* smem_row, bool trans) {
  using simt_emulator::fail;
  r[0] = r[1] = r[2] = r[3] = 0;  // what a failed load leaves
  bool ok = true;
  if (!simt_emulator::aligned(smem_row, 16)) {
    fail(cudaErrorMisalignedAddress, "ldmatrix in ", simt_emulator::where(), ": row address ", smem_row,
         " not 16-byte aligned");
    ok = false;
  } else if (!simt_emulator::self->block->in_smem(smem_row, 16)) {
    fail(cudaErrorIllegalAddress, "ldmatrix in ", simt_emulator::where(), ": row ", smem_row, " outside the block's ",
         simt_emulator::self->block->smem_bytes, " bytes of shared memory");
    ok = false;
  }
  const uint64_t words[2] = {reinterpret_cast<uintptr_t>(smem_row), ok};
  const auto op = trans ? simt_emulator::Collective::kLdmatrixTrans : simt_emulator::Collective::kLdmatrix;
  simt_emulator::warp_collective(op, words, 2, [&](const auto& slots, unsigned) {
    for (int l = 0; l < 32; ++l) {
      if (!slots[l][1]) {
        return;  // a bad row address was reported by its lane; nothing is read
      }
    }
    uint16_t m[4][8][8];  // the four 8x8 matrices as stored: [matrix][row][element]
    for (int l = 0; l < 32; ++l) {
      std::memcpy(m[l / 8][l % 8], reinterpret_cast<const void*>(static_cast<uintptr_t>(slots[l][0])), 16);
    }
    const int L = simt_emulator::lane();
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = trans ? m[i][2 * (L % 4)][L >> 2] : m[i][L >> 2][2 * (L % 4)];
      const uint16_t hi = trans ? m[i][2 * (L % 4) + 1][L >> 2] : m[i][L >> 2][2 * (L % 4) + 1];
      r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  });
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) { ldmatrix_x4_impl(r, smem_row, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) { ldmatrix_x4_impl(r, smem_row, true); }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: D = A B + C. Each lane
// computes its own four D elements (the fragment table of C/D), reading the A and B elements
// they need from the 32 lanes' fragments through the A and B tables (the products of 16-bit
// values are exact in float).
template <typename Element>
inline void mma_16816(float (&acc)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  const uint64_t words[3] = {a[0] | (static_cast<uint64_t>(a[1]) << 32), a[2] | (static_cast<uint64_t>(a[3]) << 32),
                             b0 | (static_cast<uint64_t>(b1) << 32)};
  simt_emulator::warp_collective(simt_emulator::Collective::kMma, words, 3, [&](const auto& slots, unsigned) {
    // Element `index` of a lane's fragment: A elements 0..7 in registers 0..3, B elements 0..3 in 4..5.
    auto element = [&](simt_emulator::Holder h, int first_register) {
      const int r = first_register + h.index / 2;
      const auto reg = static_cast<uint32_t>(slots[h.lane][r / 2] >> (32 * (r % 2)));
      return simt_emulator::bits_to_float(simt_emulator::half_of(reg, h.index % 2), kBf16);
    };
    const simt_emulator::Holders& at = simt_emulator::holders();
    float out[4];
    for (int i = 0; i < 4; ++i) {
      const simt_emulator::Position p = simt_emulator::c_element(simt_emulator::lane(), i);
      float sum = acc[i];
      for (int k = 0; k < 16; ++k) {
        sum += element(at.a[p.row][k], 0) * element(at.b[k][p.col], 4);
      }
      out[i] = sum;
    }
    for (int i = 0; i < 4; ++i) acc[i] = out[i];
  });
}

inline float fast_exp2(float x) { return std::exp2(x); }

}  // namespace attn_export::cuda::device
