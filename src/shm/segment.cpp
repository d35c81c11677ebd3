#include "shm/segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace stagelink::shm {

static std::string path_of(const std::string& dir, const std::string& name) { return dir + "/" + name; }

// A new file of this user's only (0600), never one that exists or a link to elsewhere.
static Result<int> create_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd >= 0) return fd;
  if (errno == EEXIST) return make_error(Errc::exists, "shared-memory segment " + path + " exists");
  return make_error(Errc::io, "create " + path + ": " + std::strerror(errno));
}

Status check_owner(const std::string& path, const struct stat& st) {
  if (st.st_uid == ::geteuid() && (st.st_mode & 077) == 0 && S_ISREG(st.st_mode)) return {};
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", unsigned(st.st_mode & 07777));
  return make_error(Errc::permission_denied,
                    "refused " + path + ": owned by uid " + std::to_string(st.st_uid) + " with mode " + mode +
                        " (stagelink opens only its own user's files, uid " + std::to_string(::geteuid()) +
                        ", mode 0600; another user may have squatted the name)");
}

Result<std::shared_ptr<Segment>> Segment::create(const std::string& dir, const std::string& name,
                                                 size_t size, bool populate) {
  std::string path = path_of(dir, name);
  SL_ASSIGN(int fd, create_file(path));
  if (size > 0) {
    int rc = ::posix_fallocate(fd, 0, off_t(size));
    if (rc != 0) {
      ::close(fd);
      ::unlink(path.c_str());
      if (rc == ENOSPC)
        return make_error(Errc::exhausted, "no space in " + dir + " for a segment of " +
                                               std::to_string(size) + " bytes (" + name + ")");
      return make_error(Errc::io, "reserve " + std::to_string(size) + " bytes for " + path + ": " +
                                      std::strerror(rc));
    }
  }
  auto seg = std::shared_ptr<Segment>(new Segment());
  seg->name_ = name;
  seg->size_ = size;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | (populate ? MAP_POPULATE : 0),
                     fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      ::unlink(path.c_str());
      return make_error(Errc::io, "mmap " + path + ": " + std::strerror(e));
    }
    seg->base_ = static_cast<std::byte*>(p);
  }
  ::close(fd);
  return seg;
}

Result<std::shared_ptr<Segment>> Segment::create_sparse(const std::string& dir, const std::string& name,
                                                        size_t size) {
  std::string path = path_of(dir, name);
  SL_ASSIGN(int fd, create_file(path));
  auto fail = [&](const char* what) {
    const int e = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return make_error(Errc::io, std::string(what) + " " + path + ": " + std::strerror(e));
  };
  if (size == 0) {
    errno = EINVAL;
    return fail("size 0 for");
  }
  if (::ftruncate(fd, off_t(size)) != 0) return fail("size");
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return fail("mmap");
  auto seg = std::shared_ptr<Segment>(new Segment());
  seg->name_ = name;
  seg->size_ = size;
  seg->base_ = static_cast<std::byte*>(p);
  seg->fd_ = fd;
  return seg;
}

Status Segment::reserve(size_t offset, size_t len) {
  if (fd_ < 0 || offset > size_ || len > size_ - offset)
    return make_error(Errc::invalid_argument, "reserve of bytes " + std::to_string(offset) + "+" + std::to_string(len) +
                                                  " of segment " + name_ + " (" + std::to_string(size_) + " bytes)");
  const int rc = ::posix_fallocate(fd_, off_t(offset), off_t(len));
  if (rc == ENOSPC)
    return make_error(Errc::exhausted, "no space in the shared-memory directory for " + std::to_string(len) +
                                           " more bytes of " + name_);
  if (rc != 0) return make_error(Errc::io, "reserve bytes of " + name_ + ": " + std::strerror(rc));
  return {};
}

Result<std::shared_ptr<Segment>> Segment::open(const std::string& dir, const std::string& name,
                                               bool writable, bool populate, size_t min_size) {
  std::string path = path_of(dir, name);
  int fd = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    const int e = errno;
    if (e == ENOENT) return make_error(Errc::not_found, "shared-memory segment " + path + " does not exist");
    // Another user's file that we may not open (EACCES, EPERM), or a link planted there (ELOOP
    // under O_NOFOLLOW): a squatted name, refused as check_owner refuses one we could open (the
    // directory then moves on to an alternate name instead of failing for good).
    if (e == EACCES || e == EPERM || e == ELOOP)
      return make_error(Errc::permission_denied,
                        "refused " + path + ": " + std::strerror(e) +
                            (e == ELOOP ? " (a symbolic link; stagelink follows none)" : " (not this user's file)") +
                            "; another user may have squatted the name");
    return make_error(Errc::io, "open " + path + ": " + std::strerror(e));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    return make_error(Errc::io, "stat " + path + ": " + std::strerror(e));
  }
  // Another user may create any name in a world-writable /dev/shm: mapping their file would hand
  // us their bytes (a pickle, a forged directory). Ours only: owned by us, no group/other bits.
  if (auto st_ok = check_owner(path, st); !st_ok.ok()) {
    ::close(fd);
    return std::move(st_ok).error();
  }
  if (size_t(st.st_size) < min_size || (min_size == 0 && st.st_size == 0)) {
    ::close(fd);
    return make_error(Errc::corrupt, "segment " + path + " has " + std::to_string(st.st_size) +
                                         " bytes, expected at least " + std::to_string(min_size));
  }
  auto seg = std::shared_ptr<Segment>(new Segment());
  seg->name_ = name;
  seg->size_ = size_t(st.st_size);
  void* p = ::mmap(nullptr, seg->size_, PROT_READ | (writable ? PROT_WRITE : 0),
                   MAP_SHARED | (populate ? MAP_POPULATE : 0), fd, 0);
  int e = errno;
  ::close(fd);
  if (p == MAP_FAILED) return make_error(Errc::io, "mmap " + path + ": " + std::strerror(e));
  seg->base_ = static_cast<std::byte*>(p);
  return seg;
}

bool Segment::unlink(const std::string& dir, const std::string& name) {
  return ::unlink(path_of(dir, name).c_str()) == 0;
}

Segment::~Segment() {
  if (base_) ::munmap(base_, size_);
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace stagelink::shm
