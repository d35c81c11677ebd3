#include "stagelink/allocator.hpp"

#include <algorithm>

#include "core/log.hpp"

namespace stagelink {

BufferAllocator::BufferAllocator(size_t capacity, size_t alignment)
    : capacity_(capacity / alignment * alignment), align_(alignment), free_bytes_(0) {
  if (capacity_ > 0) {
    free_.emplace(0, capacity_);
    free_bytes_ = capacity_;
  }
}

size_t BufferAllocator::rounded(size_t size) const {
  size_t s = size == 0 ? 1 : size;
  return (s + align_ - 1) / align_ * align_;
}

Result<size_t> BufferAllocator::allocate(size_t size) {
  if (size > capacity_)
    return make_error(Errc::exhausted, "block of " + std::to_string(size) +
                                           " bytes exceeds the pool of " + std::to_string(capacity_));
  size_t need = rounded(size);
  for (auto it = free_.begin(); it != free_.end(); ++it) {  // first fit
    if (it->second < need) continue;
    size_t off = it->first, rest = it->second - need;
    free_.erase(it);
    if (rest) free_.emplace(off + need, rest);
    free_bytes_ -= need;
    return off;
  }
  return make_error(Errc::exhausted, "no free block of " + std::to_string(need) + " bytes (" +
                                         std::to_string(free_bytes_) + " free in " +
                                         std::to_string(free_.size()) + " blocks)");
}

Status BufferAllocator::free(size_t offset, size_t size) {
  size_t len = rounded(size);
  if (offset % align_ != 0 || offset > capacity_ || len > capacity_ - offset)
    return make_error(Errc::corrupt, "free of [" + std::to_string(offset) + ", +" +
                                         std::to_string(len) + ") is outside the pool or misaligned");
  size_t end = offset + len;
  // The free block starting at or before offset, and the one after.
  auto next = free_.lower_bound(offset);
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    size_t pend = prev->first + prev->second;
    if (offset < pend) {
      if (end <= pend) {
        SL_LOG_WARN("double free of [%zu, +%zu) ignored", offset, len);
        return {};
      }
      return make_error(Errc::corrupt, "free of [" + std::to_string(offset) + ", +" +
                                           std::to_string(len) + ") partially overlaps free block [" +
                                           std::to_string(prev->first) + ", +" +
                                           std::to_string(prev->second) + ")");
    }
  }
  if (next != free_.end() && next->first < end) {
    if (next->first == offset && next->second >= len) {
      SL_LOG_WARN("double free of [%zu, +%zu) ignored", offset, len);
      return {};
    }
    return make_error(Errc::corrupt, "free of [" + std::to_string(offset) + ", +" +
                                         std::to_string(len) + ") partially overlaps free block [" +
                                         std::to_string(next->first) + ", +" +
                                         std::to_string(next->second) + ")");
  }
  size_t start = offset, total = len;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      total += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == end) {
    total += next->second;
    free_.erase(next);
  }
  free_.emplace(start, total);
  free_bytes_ += len;
  return {};
}

size_t BufferAllocator::largest_free() const {
  size_t m = 0;
  for (auto& [o, s] : free_) m = std::max(m, s);
  return m;
}

}  // namespace stagelink
