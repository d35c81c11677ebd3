#include "core/host_pool.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace stagelink::host_pool {
namespace {
constexpr size_t kHuge = 2u << 20;
// kFreshStep: each thread maps and copies one 2 MiB page at a time, copying into it while it is
// still in cache from the kernel's zeroing. 186 MiB in two threads, against 8 MiB steps: 22.8-23.0
// ms against 24.2-25.4 in a stand-alone program (6 interleaved rounds); a Python get of 186 MiB as
// `bytes` 24.2-24.5 ms against 25.1-25.3 (4 alternating runs of the two builds, 31 gets each).
constexpr size_t kFreshHugeBytes = 8u << 20, kFreshSplitBytes = 64u << 20, kFreshStep = 2u << 20;
// A copy into a cached (already mapped) buffer of this size or more runs in two threads, one half
// each: on this project's 2-core VM, 16 MiB 1.24 ms against 0.77 ms, 64 MiB 7.8 against 4.8 ms
// (a stand-alone program, medians of 30). The transfer engine's copying get copies the payload
// out of its pool after the transfer, on the get's critical path (issue 52).
constexpr size_t kWarmSplitBytes = 16u << 20;

// part(0, mid) on this thread and part(mid, n - mid) on a helper, both done on return; false (and
// nothing done) where no thread can be had, for the caller to do it all in one.
template <class F>
bool in_two_threads(size_t mid, size_t n, const F& part) {
  try {
    std::thread helper([&] { part(mid, n - mid); });
    part(size_t(0), mid);
    helper.join();
    return true;
  } catch (const std::system_error&) {
    return false;
  }
}

}  // namespace

void copy_split(std::byte* dst, const std::byte* src, size_t n) {
  auto part = [=](size_t off, size_t len) { std::memcpy(dst + off, src + off, len); };
  if (n >= kWarmSplitBytes && in_two_threads((n / 2) & ~size_t(4095), n, part)) return;
  if (n) part(0, n);
}

namespace {
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
#else
constexpr int kMadvPopulateWrite = 23;  // Linux 5.14's value; older kernels answer EINVAL
#endif

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

// allocate(n); *fresh (when given) set where the buffer is a new mapping, not a cached one.
std::shared_ptr<std::byte> allocate_impl(size_t n, bool* fresh) {
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
    if (fresh) *fresh = true;
  }
  return std::shared_ptr<std::byte>(static_cast<std::byte*>(p), [got](std::byte* b) { pool().give_back(b, got); });
}
}  // namespace

void copy_into_fresh(std::byte* dst, const std::byte* src, size_t n) {
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(dst) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(dst) + n) & ~(kHuge - 1);
  if (n < kFreshHugeBytes || hi <= lo) {
    if (n) std::memcpy(dst, src, n);
    return;
  }
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  // Maps the whole 2 MiB pages of [off, off + len) `step` bytes at a time, copying each step
  // once it is mapped.
  auto part = [&](size_t off, size_t len, size_t step) {
    for (size_t o = off; o < off + len; o += step) {
      const size_t m = std::min(step, off + len - o);
      const uintptr_t a = std::max(lo, (reinterpret_cast<uintptr_t>(dst + o) + kHuge - 1) & ~(kHuge - 1));
      const uintptr_t b = std::min(hi, reinterpret_cast<uintptr_t>(dst + o + m) & ~(kHuge - 1));
      if (b > a) madvise(reinterpret_cast<void*>(a), b - a, kMadvPopulateWrite);
      std::memcpy(dst + o, src + o, m);
    }
  };
  if (n >= kFreshSplitBytes) {
    const size_t half = ((lo + (hi - lo) / 2) & ~(kHuge - 1)) - reinterpret_cast<uintptr_t>(dst);
    if (in_two_threads(half, n, [&](size_t off, size_t len) { part(off, len, kFreshStep); })) return;
  }
  part(0, n, n);  // one thread: mapping it all in one call, then one copy, is the faster order
}

std::shared_ptr<std::byte> copy_of(std::span<const std::byte> src) {
  bool fresh = false;
  std::shared_ptr<std::byte> buf = allocate_impl(src.size(), &fresh);
  if (!buf || src.empty()) return buf;
  if (fresh)
    copy_into_fresh(buf.get(), src.data(), src.size());
  else
    copy_split(buf.get(), src.data(), src.size());
  return buf;
}

std::shared_ptr<std::byte> allocate(size_t n) { return allocate_impl(n, nullptr); }

std::shared_ptr<std::byte> allocate_mapped(size_t n) {
  bool fresh = false;
  std::shared_ptr<std::byte> buf = allocate_impl(n, &fresh);
  if (!buf || !fresh) return buf;  // (fresh: a new mapping, 1 MiB and more)
  // A new mapping: the kernel's faults (and zeroing) now, 2 MiB at a time, in two threads from
  // 16 MiB, instead of one 4 KiB fault at a time inside whatever writes it (a socket's receive).
  auto* base = buf.get();
  const size_t cap = (n + kHuge - 1) / kHuge * kHuge;
  auto populate = [base](size_t off, size_t len) {
    if (madvise(base + off, len, kMadvPopulateWrite) != 0)  // before Linux 5.14: touch each page
      for (size_t o = off; o < off + len; o += 4096) reinterpret_cast<volatile char*>(base)[o] = 0;
  };
  if (cap < kWarmSplitBytes || !in_two_threads(cap / 2 / kHuge * kHuge, cap, populate)) populate(0, cap);
  return buf;
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
