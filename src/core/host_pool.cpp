#include "core/host_pool.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace stagelink::host_pool {
namespace {
constexpr size_t kHuge = 2u << 20;

size_t limit_from_env() {
  const char* s = std::getenv("STAGELINK_HOST_CACHE_MB");
  if (!s || !*s) return size_t(1024) << 20;
  char* end = nullptr;
  const unsigned long long mb = std::strtoull(s, &end, 10);
  return (end && *end == '\0') ? size_t(mb) << 20 : size_t(1024) << 20;
}

struct Block {
  void* p;
  size_t cap;
};

// Leaked on purpose: buffers may be released by static destructors after main returns.
struct Pool {
  std::mutex mu;
  std::vector<Block> idle;  // oldest first
  size_t idle_bytes = 0;
  const size_t limit = limit_from_env();
  uint64_t hits = 0, misses = 0;

  void give_back(void* p, size_t cap) {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (cap <= limit) {
        while (idle_bytes + cap > limit && !idle.empty()) {  // make room: the oldest go first
          drop.push_back(idle.front());
          idle_bytes -= idle.front().cap;
          idle.erase(idle.begin());
        }
        idle.push_back(Block{p, cap});
        idle_bytes += cap;
        p = nullptr;
      }
    }
    for (auto& b : drop) munmap(b.p, b.cap);  // outside the lock: unmapping 100s of MiB takes ms
    if (p) munmap(p, cap);
  }

  void* take(size_t cap, size_t& got) {
    std::lock_guard<std::mutex> lock(mu);
    size_t best = idle.size();
    for (size_t i = 0; i < idle.size(); ++i)
      if (idle[i].cap >= cap && idle[i].cap / 2 <= cap && (best == idle.size() || idle[i].cap < idle[best].cap))
        best = i;
    if (best == idle.size()) {
      ++misses;
      return nullptr;
    }
    ++hits;
    void* p = idle[best].p;
    got = idle[best].cap;
    idle_bytes -= got;
    idle.erase(idle.begin() + long(best));
    return p;
  }
};

Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}
}  // namespace

std::shared_ptr<std::byte> allocate(size_t n) {
  if (n < kPooledMin) {
    // Small: malloc's own free lists keep these warm; one allocation for data and count.
    try {
      auto s = std::make_shared_for_overwrite<std::byte[]>(n);
      return std::shared_ptr<std::byte>(s, s.get());
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  const size_t cap = (n + kHuge - 1) / kHuge * kHuge;
  size_t got = cap;
  void* p = pool().take(cap, got);
  if (!p) {
    // Over-map by one huge page and trim, so the buffer starts on a 2 MiB boundary: only aligned
    // 2 MiB ranges can be backed by huge pages.
    void* raw = mmap(nullptr, cap + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kHuge - 1) / kHuge * kHuge;
    if (aligned > start) munmap(raw, aligned - start);
    if (start + kHuge > aligned) munmap(reinterpret_cast<void*>(aligned + cap), start + kHuge - aligned);
    p = reinterpret_cast<void*>(aligned);
    madvise(p, cap, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  }
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [got](std::byte* b) { pool().give_back(b, got); });
}

Stats stats() {
  auto& pl = pool();
  std::lock_guard<std::mutex> lock(pl.mu);
  return Stats{pl.idle_bytes, pl.idle.size(), pl.limit, pl.hits, pl.misses};
}

void trim() {
  auto& pl = pool();
  std::vector<Block> drop;
  {
    std::lock_guard<std::mutex> lock(pl.mu);
    drop.swap(pl.idle);
    pl.idle_bytes = 0;
  }
  for (auto& b : drop) munmap(b.p, b.cap);
}

}  // namespace stagelink::host_pool
