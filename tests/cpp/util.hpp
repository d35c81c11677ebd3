// Helpers shared by the multi-process tests.
#pragma once
#include <sys/wait.h>

#include <cstdint>
#include <span>

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
}  // namespace stagelink::testing_util
