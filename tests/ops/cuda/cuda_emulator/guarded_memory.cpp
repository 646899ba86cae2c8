// See guarded_memory.h.
#include "guarded_memory.h"

#include <c10/core/CPUAllocator.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "guarded_memory_scope.h"

namespace guarded_memory {
namespace {

constexpr size_t kGuard = 256;          // bytes on each side
constexpr size_t kAlignment = 256;      // what cudaMalloc gives, and the backward's workspace needs
constexpr unsigned char kPoison = 0xFF;

struct Buffer {
  size_t bytes;        // what was asked for
  size_t total;        // guard + rounded-up bytes + guard
  unsigned char* base;
};

struct Registry {
  std::mutex mutex;
  std::map<const unsigned char*, Buffer> live;  // by data pointer
};
Registry& registry() {
  static Registry r;
  return r;
}

void release(void* base) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto it = r.live.begin(); it != r.live.end(); ++it) {
      if (it->second.base == base) {
        r.live.erase(it);
        break;
      }
    }
  }
  std::free(base);
}

struct GuardedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    const size_t body = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    const size_t total = 2 * kGuard + body;
    auto* base = static_cast<unsigned char*>(std::aligned_alloc(kAlignment, total));
    TORCH_CHECK(base != nullptr, "guarded allocator: out of memory");
    std::memset(base, kPoison, total);
    unsigned char* data = base + kGuard;
    {
      Registry& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.live[data] = {bytes, total, base};
    }
    return {data, base, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

GuardedAllocator& guarded_allocator() {
  static GuardedAllocator a;
  return a;
}

constexpr uint8_t kPriority = 100;  // above the default allocator's, so the swap takes effect

}  // namespace

bool in_bounds(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.live.empty()) {
    return true;
  }
  auto it = r.live.upper_bound(c);
  if (it == r.live.begin()) {
    return false;
  }
  --it;
  return c + bytes <= it->first + it->second.bytes;
}

std::string damaged_guards() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (const auto& [data, buffer] : r.live) {
    const unsigned char* end = buffer.base + buffer.total;
    for (const unsigned char* b = buffer.base; b < end; ++b) {
      const bool guard = b < data || b >= data + buffer.bytes;
      if (guard && *b != kPoison) {
        std::ostringstream s;
        s << "byte " << (b - data) << " of a " << buffer.bytes << "-byte buffer";
        return s.str();
      }
    }
  }
  return "";
}

Scope::Scope() : previous_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(&guarded_allocator(), kPriority); }
Scope::~Scope() { c10::SetCPUAllocator(previous_, kPriority); }

at::Tensor guarded_copy(const at::Tensor& t) {
  if (!t.defined()) {
    return t;
  }
  const size_t bytes = t.storage().nbytes();
  at::Tensor storage = at::empty({static_cast<int64_t>(bytes)}, t.options().dtype(at::kByte));
  if (bytes > 0) {
    std::memcpy(storage.data_ptr(), t.storage().data(), bytes);
  }
  return at::empty({0}, t.options()).set_(storage.storage(), t.storage_offset(), t.sizes(), t.strides());
}

}  // namespace guarded_memory
