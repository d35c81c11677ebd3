// Host buffers for received payloads (internal).
//
// A copying get writes into memory the caller then owns. Fresh memory from the kernel costs a
// page fault per 4 KiB page on first touch: for 186 MiB that is ~47,000 faults, and the copy ran
// at a fifth of memcpy speed. Buffers of 1 MiB and more therefore come from anonymous mappings
// advised for transparent huge pages (one fault per 2 MiB) and, when the last holder drops them,
// return to a small process-wide cache instead of the kernel, so a pipeline that receives
// tensors of the same size step after step copies into memory that is already faulted in. A
// fresh buffer (a cache miss, or a new Python bytes) has its pages mapped ahead of the copy
// (copy_into_fresh, below).
//
// The cache holds at most STAGELINK_HOST_CACHE_MB mebibytes of idle buffers (default 1024; 0
// turns it off); a buffer is reused for a request of at least half its size.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace stagelink::host_pool {

inline constexpr size_t kPooledMin = 1u << 20;

// n writable bytes (contents undefined), aligned to 16 (pooled ones to 2 MiB); nullptr when the
// system has no memory.
std::shared_ptr<std::byte> allocate(size_t n);

// allocate(n), its pages mapped: a new mapping is populated before it returns (2 MiB pages, in two
// threads from 16 MiB), for memory something else then writes (a transport's receive), which would
// otherwise take a fault per 4 KiB page inside its copy. Call without the GIL.
std::shared_ptr<std::byte> allocate_mapped(size_t n);

// A copy of `src`: allocate(src.size()) filled. A pooled buffer is already mapped (16 MiB and
// more copied in two threads); a fresh one is filled by copy_into_fresh. nullptr when the system has no memory. Call without the GIL.
std::shared_ptr<std::byte> copy_of(std::span<const std::byte> src);

// memcpy of `n` bytes into mapped memory, in two threads from 16 MiB (one if no thread can be
// had). Call without the GIL.
void copy_split(std::byte* dst, const std::byte* src, size_t n);

// Copies `n` bytes into `dst`, memory the kernel has not mapped yet (a fresh anonymous mapping,
// malloc's for a large block): from 8 MiB its 2 MiB pages are advised huge and mapped ahead of
// the copy in one call each, and from 64 MiB two threads each map and copy half, a 2 MiB page at
// a time. Measured at 186 MiB on this project's VM, against 18 ms for one memcpy into mapped
// memory: faulting 4 KiB pages in during the copy 116 ms; 2 MiB pages 55 ms; mapped first
// (MADV_POPULATE_WRITE, Linux 5.14+) 40 ms; in two threads 26 ms in 8 MiB steps, 23 ms in 2 MiB
// steps (4 KiB pages mapped ahead in steps instead: 30-32 ms). The advices are hints: an older
// kernel faults as before.
void copy_into_fresh(std::byte* dst, const std::byte* src, size_t n);

struct Stats {
  size_t cached_bytes = 0, cached_buffers = 0, limit_bytes = 0;
  uint64_t hits = 0, misses = 0;
};
Stats stats();
// Return every idle buffer to the kernel.
void trim();

}  // namespace stagelink::host_pool
