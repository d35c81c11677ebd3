// A named shared-memory segment: a file under the shm directory (default /dev/shm), created
// exclusively with mode 0600 and fully reserved with posix_fallocate, so a full /dev/shm is an
// error at creation instead of a SIGBUS later; or created sparse, and reserved range by range
// (`reserve`) before those bytes are written.
#pragma once
#include <sys/stat.h>

#include <cstddef>
#include <memory>
#include <string>

#include "stagelink/result.hpp"

namespace stagelink::shm {

// Ok when the file `st` describes is ours to trust: a regular file owned by the effective uid with
// no group or other permission bits. Else permission_denied naming `path`, its owner and mode.
Status check_owner(const std::string& path, const struct stat& st);

class Segment {
 public:
  // Errors: exists (name taken), exhausted (no space), io.
  static Result<std::shared_ptr<Segment>> create(const std::string& dir, const std::string& name,
                                                 size_t size, bool populate);
  // Sized but not reserved: nothing of it may be written before `reserve` covered it (a write to
  // an unreserved page of a full /dev/shm is a SIGBUS). Errors: exists, io.
  static Result<std::shared_ptr<Segment>> create_sparse(const std::string& dir, const std::string& name,
                                                        size_t size);
  // Reserve [offset, offset + len) of a sparse segment (posix_fallocate). Errors: exhausted (no
  // space), io.
  Status reserve(size_t offset, size_t len);
  // Errors: not_found, permission_denied (not ours: check_owner), corrupt (smaller than
  // min_size), io.
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
  int fd_ = -1;  // kept open by create_sparse, for reserve
  std::string name_;
};

}  // namespace stagelink::shm
