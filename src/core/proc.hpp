// Process identity that survives pid reuse: pid plus the kernel's start time of that pid.
#pragma once
#include <cstdint>

namespace stagelink {
struct ProcId {
  uint32_t pid = 0;
  uint64_t start = 0;  // /proc/<pid>/stat field 22 (clock ticks since boot); 0 if unknown
};
ProcId self_proc();
// How many forks separate this process from the one that loaded stagelink (0 there, 1 in its
// child, ...): an object made in one generation and used in another was inherited through fork(),
// and what it holds of shared state belongs to the process that made it. A load of one word.
uint32_t fork_generation();
// What an object holding process-owned shared state (an attachment, an arena, sockets) carries to
// tell whether it was inherited through fork(): `inherited()` in a forked child, where that state
// is the parent's and must be left alone. `adopt()` makes the current process its owner.
struct ForkStamp {
  uint32_t gen = fork_generation();
  bool inherited() const { return gen != fork_generation(); }
  void adopt() { gen = fork_generation(); }
};
uint64_t proc_start_time(uint32_t pid);  // 0 when the process does not exist or cannot be read
// Alive: the pid exists and, when start is known, started at the same time. Dead only on the
// kernel's word (ESRCH, ENOENT, a zombie, another start time): a /proc read that fails for any
// other reason (EMFILE, ENFILE, EACCES, ENOMEM) is "alive", so no reaper frees a live process's
// data because the reaper's own process ran out of descriptors.
bool proc_alive(const ProcId& p);
uint64_t now_ns();       // CLOCK_REALTIME in ns (ages shown to users)
uint64_t mono_ns();      // CLOCK_MONOTONIC in ns
// The mono_ns() deadline `timeout_s` from `now`; 0 (none: wait for ever) for a negative, infinite,
// NaN or absurd (1e9 s and more) timeout, whose nanoseconds would overflow.
inline uint64_t deadline_ns(double timeout_s, uint64_t now) {
  if (!(timeout_s >= 0) || !(timeout_s < 1e9)) return 0;
  return now + uint64_t(timeout_s * 1e9);
}
}  // namespace stagelink
