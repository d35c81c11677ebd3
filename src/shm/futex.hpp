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

// A sequence word and a count of its sleepers, for waits that many processes share. The sleeper
// counts itself, re-checks the word and only then sleeps; the waker moves the word and then reads
// the count: either the waker sees the sleeper or the sleeper's re-check sees the move (seq_cst on
// both sides), and a waker with nobody asleep makes no system call.
// Sleeps while the word reads `seen`, at most until `deadline_ns` (0: no limit); false on the deadline.
inline bool futex_wait_counted(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters, uint32_t seen,
                               uint64_t deadline_ns) {
  waiters.fetch_add(1, std::memory_order_seq_cst);
  bool ok = true;
  if (word.load(std::memory_order_seq_cst) == seen) ok = futex_wait(&word, seen, deadline_ns);
  waiters.fetch_sub(1, std::memory_order_seq_cst);
  return ok;
}
inline void futex_bump_wake(std::atomic<uint32_t>& word, std::atomic<uint32_t>& waiters) {
  word.fetch_add(1, std::memory_order_seq_cst);
  if (waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(&word);
}

}  // namespace stagelink::shm
