// Host buffers for received payloads (internal).
//
// A copying get writes into memory the caller then owns. Fresh memory from the kernel costs a
// page fault per 4 KiB page on first touch: for 186 MiB that is ~47,000 faults, and the copy ran
// at a fifth of memcpy speed. Buffers of 1 MiB and more therefore come from anonymous mappings
// advised for transparent huge pages (one fault per 2 MiB) and, when the last holder drops them,
// return to a small process-wide cache instead of the kernel, so a pipeline that receives
// tensors of the same size step after step copies into memory that is already faulted in.
//
// The cache holds at most STAGELINK_HOST_CACHE_MB mebibytes of idle buffers (default 1024; 0
// turns it off); a buffer is reused for a request of at least half its size.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace stagelink::host_pool {

inline constexpr size_t kPooledMin = 1u << 20;

// n writable bytes (contents undefined), aligned to 16 (pooled ones to 2 MiB); nullptr when the
// system has no memory.
std::shared_ptr<std::byte> allocate(size_t n);

struct Stats {
  size_t cached_bytes = 0, cached_buffers = 0, limit_bytes = 0;
  uint64_t hits = 0, misses = 0;
};
Stats stats();
// Return every idle buffer to the kernel.
void trim();

}  // namespace stagelink::host_pool
