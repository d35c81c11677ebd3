// BufferAllocator: aligned first-fit sub-range allocator over a pool of `capacity` bytes.
// Not thread-safe: the owner serializes calls. A double free (exact or contained in a free
// block) is logged and ignored; a partial overlap with a free block is reported as corruption.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "stagelink/result.hpp"

namespace stagelink {

class BufferAllocator {
 public:
  explicit BufferAllocator(size_t capacity, size_t alignment = 4096);
  // Offset of a block of at least `size` bytes (rounded up to the alignment). Errors: exhausted,
  // invalid_argument (size 0 is allowed and returns a 1-alignment block).
  Result<size_t> allocate(size_t size);
  // Return a block. Errors: corrupt (partial overlap / outside the pool). Double free: ok + log.
  Status free(size_t offset, size_t size);
  size_t capacity() const { return capacity_; }
  size_t used() const { return capacity_ - free_bytes_; }
  size_t free_bytes() const { return free_bytes_; }
  size_t largest_free() const;
  size_t alignment() const { return align_; }
  size_t free_blocks() const { return free_.size(); }
  size_t rounded(size_t size) const;

 private:
  size_t capacity_, align_, free_bytes_;
  struct Block {
    size_t offset, size;
  };
  // Free blocks sorted by offset, never adjacent. A flat vector: the common case (an arena used
  // first-in first-out) keeps a handful of blocks, and no call allocates.
  std::vector<Block> free_;
};

}  // namespace stagelink
