// Futex wait/wake on a 32-bit word in shared memory (process-shared, not FUTEX_PRIVATE).
#pragma once
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <ctime>

namespace stagelink::shm {

// Sleeps while *word == expected, at most until `deadline_ns` (CLOCK_MONOTONIC ns; 0 = no limit).
// Returns false when the deadline passed.
inline bool futex_wait(std::atomic<uint32_t>* word, uint32_t expected, uint64_t deadline_ns) {
  timespec ts{}, *tsp = nullptr;
  if (deadline_ns) {
    ts.tv_sec = time_t(deadline_ns / 1000000000ull);
    ts.tv_nsec = long(deadline_ns % 1000000000ull);
    tsp = &ts;
  }
  // FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC deadline: no drift across spurious wakes.
  long r = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_BITSET, expected, tsp,
                   nullptr, FUTEX_BITSET_MATCH_ANY);
  return !(r == -1 && errno == ETIMEDOUT);
}

inline void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace stagelink::shm
