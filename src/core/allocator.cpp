#include "stagelink/allocator.hpp"

#include <algorithm>

#include "core/log.hpp"

namespace stagelink {

BufferAllocator::BufferAllocator(size_t capacity, size_t alignment)
    : capacity_(capacity / alignment * alignment), align_(alignment), free_bytes_(0) {
  if (capacity_ > 0) {
    free_.push_back(Block{0, capacity_});
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
  const size_t need = rounded(size);
  for (size_t i = 0; i < free_.size(); ++i) {  // first fit
    Block& b = free_[i];
    if (b.size < need) continue;
    const size_t off = b.offset;
    if (b.size == need) {
      free_.erase(free_.begin() + ptrdiff_t(i));
    } else {
      b.offset += need;  // stays between its neighbours: the order holds
      b.size -= need;
    }
    free_bytes_ -= need;
    return off;
  }
  return make_error(Errc::exhausted, "no free block of " + std::to_string(need) + " bytes (" +
                                         std::to_string(free_bytes_) + " free in " +
                                         std::to_string(free_.size()) + " blocks)");
}

Status BufferAllocator::free(size_t offset, size_t size) {
  const size_t len = rounded(size);
  if (offset % align_ != 0 || offset > capacity_ || len > capacity_ - offset)
    return make_error(Errc::corrupt, "free of [" + std::to_string(offset) + ", +" +
                                         std::to_string(len) + ") is outside the pool or misaligned");
  const size_t end = offset + len;
  auto overlap = [&](const Block& b) {
    return make_error(Errc::corrupt, "free of [" + std::to_string(offset) + ", +" + std::to_string(len) +
                                         ") partially overlaps free block [" + std::to_string(b.offset) + ", +" +
                                         std::to_string(b.size) + ")");
  };
  // The first free block at or after offset, and the one before it.
  auto next = std::lower_bound(free_.begin(), free_.end(), offset,
                               [](const Block& b, size_t off) { return b.offset < off; });
  Block* prev = next == free_.begin() ? nullptr : &*std::prev(next);
  if (prev && offset < prev->offset + prev->size) {
    if (end <= prev->offset + prev->size) {
      SL_LOG_WARN("double free of [%zu, +%zu) ignored", offset, len);
      return {};
    }
    return overlap(*prev);
  }
  if (next != free_.end() && next->offset < end) {
    if (next->offset == offset && next->size >= len) {
      SL_LOG_WARN("double free of [%zu, +%zu) ignored", offset, len);
      return {};
    }
    return overlap(*next);
  }
  const bool join_prev = prev && prev->offset + prev->size == offset;
  const bool join_next = next != free_.end() && next->offset == end;
  if (join_prev && join_next) {
    prev->size += len + next->size;
    free_.erase(next);
  } else if (join_prev) {
    prev->size += len;
  } else if (join_next) {
    next->offset = offset;
    next->size += len;
  } else {
    free_.insert(next, Block{offset, len});
  }
  free_bytes_ += len;
  return {};
}

size_t BufferAllocator::largest_free() const {
  size_t m = 0;
  for (const Block& b : free_) m = std::max(m, b.size);
  return m;
}

}  // namespace stagelink
