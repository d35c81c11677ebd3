// Helpers shared by the multi-process tests.
#pragma once
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "stagelink/payload.hpp"

// A Status (or Result) that must be ok; when it is not, the failure shows its error, which
// names what was missing (a bare ASSERT_TRUE(x.ok()) shows only "false").
#define ASSERT_OK(expr)                                           \
  do {                                                            \
    const auto& sl_status_ = (expr);                              \
    ASSERT_TRUE(sl_status_.ok()) << sl_status_.error().to_string(); \
  } while (0)

namespace stagelink::testing_util {
// FNV-1a over the bytes.
inline uint64_t checksum(std::span<const std::byte> s) {
  uint64_t h = 1469598103934665603ull;
  for (auto b : s) h = (h ^ uint64_t(b)) * 1099511628211ull;
  return h;
}
// Exit code of a child, or 128 + the signal that killed it.
inline int wait_child(pid_t pid) {
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
// A child forked before the test starts any thread, which runs `body` on bytes the parent sends
// it later (a queue's handle, made after the fork). gcc 12's AddressSanitizer allocator is not
// fork-safe: a child forked while a ZeroMQ or UCX thread of the parent holds its lock can hang in
// malloc. Forking first leaves the child nothing to inherit. The child exits with body's result;
// 100 when the parent went before sending (its pipe closed). The destructor reclaims the child:
// it closes the pipe, and kills a child still running after a failed test.
class EarlyChild {
 public:
  explicit EarlyChild(std::function<int(std::span<const std::byte>)> body) {
    int fd[2];
    if (pipe(fd) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      close(fd[1]);
      uint64_t n = 0;
      if (!read_all(fd[0], &n, sizeof n) || n > (64u << 20)) _exit(100);
      std::vector<std::byte> b(n);
      if (!read_all(fd[0], b.data(), n)) _exit(100);
      close(fd[0]);
      _exit(body(b));
    }
    close(fd[0]);
    fd_ = pid_ > 0 ? fd[1] : (close(fd[1]), -1);
  }
  ~EarlyChild() {
    if (fd_ >= 0) close(fd_);
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  EarlyChild(const EarlyChild&) = delete;
  EarlyChild& operator=(const EarlyChild&) = delete;
  bool ok() const { return pid_ > 0 && fd_ >= 0; }
  pid_t pid() const { return pid_; }
  // Hands the child its bytes (once); false when the pipe is gone (the child died).
  bool send(std::span<const std::byte> b) {
    const uint64_t n = b.size();
    const bool sent = fd_ >= 0 && write_all(fd_, &n, sizeof n) && write_all(fd_, b.data(), b.size());
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    return sent;
  }
  // The child's exit code (128 + the signal that killed it).
  int wait() {
    reaped_ = true;
    return wait_child(pid_);
  }

 private:
  static bool read_all(int fd, void* p, size_t n) {
    auto* c = static_cast<char*>(p);
    while (n) {
      const ssize_t r = read(fd, c, n);
      if (r <= 0) return false;
      c += r, n -= size_t(r);
    }
    return true;
  }
  static bool write_all(int fd, const void* p, size_t n) {
    auto* c = static_cast<const char*>(p);
    while (n) {
      const ssize_t r = write(fd, c, n);
      if (r <= 0) return false;
      c += r, n -= size_t(r);
    }
    return true;
  }
  pid_t pid_ = -1;
  int fd_ = -1;
  bool reaped_ = false;
};
// A 4 MiB tmpfs of its own, unmounted and removed when it goes; `ok()` is false where this
// process may not mount (not root), and the test should skip.
class SmallTmpfs {
 public:
  SmallTmpfs() {
    char tmpl[] = "/tmp/stagelink-tmpfs-XXXXXX";
    if (!mkdtemp(tmpl)) return;
    dir_ = tmpl;
    mounted_ = mount("tmpfs", dir_.c_str(), "tmpfs", 0, "size=4m") == 0;
  }
  ~SmallTmpfs() {
    if (mounted_) umount(dir_.c_str());
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
  bool ok() const { return mounted_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  bool mounted_ = false;
};
// Reproducible pseudo-random bytes (xorshift32).
inline std::vector<std::byte> pattern(size_t n, uint32_t seed) {
  std::vector<std::byte> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13; x ^= x >> 17; x ^= x << 5;
    v[i] = std::byte(x);
  }
  return v;
}
// A payload of one tensor viewing `d` (the tree: {"t": tensor 0, "n": its size}).
inline Payload payload_of(const std::vector<std::byte>& d) {
  Payload p;
  p.tensors.push_back(Tensor::view_of(std::span<const std::byte>(d)));
  Value::Map m;
  m.emplace_back("t", TensorRef{0});
  m.emplace_back("n", uint64_t(d.size()));
  p.tree = Value(std::move(m));
  return p;
}
}  // namespace stagelink::testing_util
