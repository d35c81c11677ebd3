// Helpers shared by the multi-process tests.
#pragma once
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
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
