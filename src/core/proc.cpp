#include "core/proc.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

namespace stagelink {

// What reading /proc/PID/stat said: the process's start time (and state), that it is gone
// (ENOENT/ESRCH: the only answers that may mean dead), or nothing known (EMFILE, ENFILE, EACCES,
// ENOMEM, a short or odd read: a process out of descriptors must never take its peers for dead).
enum class StatRead { kOk, kGone, kUnknown };

static StatRead proc_stat(uint32_t pid, uint64_t* start, char* state) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%u/stat", pid);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return (errno == ENOENT || errno == ESRCH) ? StatRead::kGone : StatRead::kUnknown;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  const int read_errno = errno;
  ::close(fd);
  if (n < 0) return read_errno == ESRCH ? StatRead::kGone : StatRead::kUnknown;
  if (n == 0) return StatRead::kUnknown;
  buf[n] = 0;
  // The command name (field 2) may contain spaces and parentheses: skip to the last ')'.
  char* p = std::strrchr(buf, ')');
  if (!p || p[1] != ' ' || !p[2]) return StatRead::kUnknown;
  p += 2;  // now at field 3 (state)
  if (state) *state = *p;
  for (int field = 3; field < 22 && *p; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return StatRead::kUnknown;
    ++p;
  }
  *start = std::strtoull(p, nullptr, 10);
  return *start ? StatRead::kOk : StatRead::kUnknown;
}

uint64_t proc_start_time(uint32_t pid) {
  uint64_t s = 0;
  return proc_stat(pid, &s, nullptr) == StatRead::kOk ? s : 0;
}

// getpid() is a system call in this glibc and self_proc() sits on every put and get: cache the
// identity, and forget it in a forked child (pthread_atfork) so the child never claims as its parent.
namespace {
std::atomic<uint64_t> g_self_pid{0};  // 0: unknown
std::atomic<uint64_t> g_self_start{0};
std::atomic<uint32_t> g_fork_gen{0};  // forks this process descends from, counted in each child
void forget_self() {
  g_self_pid.store(0, std::memory_order_relaxed);
  g_fork_gen.fetch_add(1, std::memory_order_relaxed);
}
// Registered before the first identity or generation is handed out: a fork before that changes
// nothing anyone holds.
const int g_atfork_registered = pthread_atfork(nullptr, nullptr, forget_self);
}  // namespace

uint32_t fork_generation() { return g_fork_gen.load(std::memory_order_relaxed); }

ProcId self_proc() {
  (void)g_atfork_registered;
  uint64_t pid = g_self_pid.load(std::memory_order_acquire);
  if (pid != 0) return ProcId{uint32_t(pid), g_self_start.load(std::memory_order_relaxed)};
  const uint32_t now = static_cast<uint32_t>(::getpid());
  const uint64_t start = proc_start_time(now);
  if (start == 0) return ProcId{now, 0};  // unreadable now (out of descriptors): ask again next time
  g_self_start.store(start, std::memory_order_relaxed);
  g_self_pid.store(now, std::memory_order_release);
  return ProcId{now, start};
}

bool proc_alive(const ProcId& p) {
  if (p.pid == 0) return false;
  // ESRCH is the kernel saying no such process; EPERM (another user's) means it exists.
  if (::kill(static_cast<pid_t>(p.pid), 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  uint64_t s = 0;
  switch (proc_stat(p.pid, &s, &state)) {
    case StatRead::kGone: return false;
    case StatRead::kUnknown: return true;  // cannot tell: alive (a reap is never a guess)
    case StatRead::kOk: break;
  }
  // A killed process that its parent has not waited for yet is a zombie: dead for our purposes.
  if (state == 'Z' || state == 'X') return false;
  return p.start == 0 || s == p.start;
}

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
}
uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
}
}  // namespace stagelink
