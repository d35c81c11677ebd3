// A named shared-memory segment: a file under the shm directory (default /dev/shm), created
// exclusively with mode 0600 and fully reserved with posix_fallocate, so a full /dev/shm is an
// error at creation instead of a SIGBUS later.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

#include "stagelink/result.hpp"

namespace stagelink::shm {

class Segment {
 public:
  // Errors: exists (name taken), exhausted (no space), io.
  static Result<std::shared_ptr<Segment>> create(const std::string& dir, const std::string& name,
                                                 size_t size, bool populate);
  // Errors: not_found, corrupt (smaller than min_size), io.
  static Result<std::shared_ptr<Segment>> open(const std::string& dir, const std::string& name,
                                               bool writable, bool populate, size_t min_size = 0);
  static bool unlink(const std::string& dir, const std::string& name);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  std::byte* data() const { return base_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  Segment() = default;
  std::byte* base_ = nullptr;
  size_t size_ = 0;
  std::string name_;
};

}  // namespace stagelink::shm
