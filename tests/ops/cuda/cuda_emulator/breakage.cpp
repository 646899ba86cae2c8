// Tiny purpose-written kernels, each with one deliberate synchronization bug of the kind a first
// GPU run finds (or its correct twin), run by the SIMT emulator (simt_emulator.h) in a standalone
// program built with ThreadSanitizer (tests/ops/cuda/test_emulator_breakage.py):
//
//     breakage CASE late|early        prints "result: ok" / "result: wrong ..." and the
//                                     emulator's error, if any; TSan reports go to stderr
//
// It shows that the emulator catches the bugs it claims to, on kernels small enough to read:
//   exchange_*      threads read what another warp wrote to shared memory; without the
//                   __syncthreads between the write and the read, TSan reports a data race;
//   refill_*        a cp.async refill of a shared buffer other threads still read; without the
//                   __syncthreads before the refill, TSan reports a race under either ordering
//                   (the copy lands when issued, or at the wait);
//   read_before_wait_*   a thread reads its cp.async destination before cp.async.wait_group:
//                   under the late ordering it reads the NaN poison of fresh shared memory.
// The other bug classes (launch limits, the 48 KB shared-memory opt-in, alignment, guard zones,
// shuffle masks, divergence) have their cases in emulator_selftest.cpp. No torch: global memory
// here is plain host memory (the guard zones of guarded_memory.cpp need the torch allocator).
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "simt_emulator.h"

namespace guarded_memory {  // no guarded buffers in this program: every address is a buffer's
bool in_bounds(const void*, size_t) { return true; }
std::string damaged_guards() { return ""; }
}  // namespace guarded_memory

namespace {

using namespace attn_export::cuda::device;

constexpr int kThreads = 64;  // two warps
constexpr int kChunk = 4;     // floats per 16-byte cp.async

// Thread t writes slot t, then reads slot t + 32 (a thread of the other warp).
void exchange(bool sync, float* out) {
  float* s = shared_memory<float>();
  const int t = threadIdx.x;
  s[t] = static_cast<float>(t + 1);
  if (sync) {
    __syncthreads();
  }
  out[t] = s[(t + kThreads / 2) % kThreads];
}

// Two tiles through one shared buffer: thread t copies chunk t of each tile, and reads chunk
// t + 1 (its neighbour's). The refill of the buffer with tile 1 must wait until every thread is
// done reading tile 0.
void refill(bool sync, const float* src, float* out) {
  float* s = shared_memory<float>();
  const int t = threadIdx.x, next = (t + 1) % kThreads;
  float sum = 0.f;
  for (int tile = 0; tile < 2; ++tile) {
    if (tile > 0 && sync) {
      __syncthreads();  // every read of the previous tile is done
    }
    cp_async_16(s + kChunk * t, src + kThreads * kChunk * tile + kChunk * t, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    sum += s[kChunk * next];
  }
  out[t] = sum;
}

// Thread t copies chunk t and reads its first element, before or after waiting for the copy.
void read_before_wait(bool wait_first, const float* src, float* out) {
  float* s = shared_memory<float>();
  const int t = threadIdx.x;
  cp_async_16(s + kChunk * t, src + kChunk * t, true);
  cp_async_commit();
  if (wait_first) {
    cp_async_wait<0>();
  }
  out[t] = s[kChunk * t];
  cp_async_wait<0>();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[2], "late") != 0 && std::strcmp(argv[2], "early") != 0)) {
    std::fprintf(stderr, "usage: breakage CASE late|early\n");
    return 2;
  }
  const std::string name = argv[1];
  simt_emulator::copies_land_early = std::strcmp(argv[2], "early") == 0;
  const bool correct = name.size() > 6 && name.substr(name.size() - 6) == "_fixed";
  const std::string kernel = name.substr(0, name.rfind('_'));

  std::vector<float> src(2 * kThreads * kChunk), out(kThreads, -1.f), expected(kThreads);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i);
  const size_t smem = kThreads * kChunk * sizeof(float);
  if (kernel == "exchange") {
    simt_emulator::launch(exchange, dim3(1), dim3(kThreads), smem, correct, out.data());
    for (int t = 0; t < kThreads; ++t) expected[t] = static_cast<float>((t + kThreads / 2) % kThreads + 1);
  } else if (kernel == "refill") {
    simt_emulator::launch(refill, dim3(1), dim3(kThreads), smem, correct, static_cast<const float*>(src.data()),
                          out.data());
    for (int t = 0; t < kThreads; ++t) {
      const int next = (t + 1) % kThreads;
      expected[t] = src[kChunk * next] + src[kThreads * kChunk + kChunk * next];
    }
  } else if (kernel == "read_before_wait") {
    simt_emulator::launch(read_before_wait, dim3(1), dim3(kThreads), smem, correct,
                          static_cast<const float*>(src.data()), out.data());
    for (int t = 0; t < kThreads; ++t) expected[t] = src[kChunk * t];
  } else {
    std::fprintf(stderr, "breakage: no case '%s'\n", name.c_str());
    return 2;
  }
  int wrong = 0;
  for (int t = 0; t < kThreads; ++t) wrong += !(out[t] == expected[t]);  // NaN counts as wrong
  if (wrong) {
    std::printf("result: wrong in %d of %d threads (thread 0: %g, expected %g)\n", wrong, kThreads, out[0],
                expected[0]);
  } else {
    std::printf("result: ok\n");
  }
  const std::string error = simt_emulator::first_error();
  std::printf("error: %s\n", error.c_str());
  return 0;
}
