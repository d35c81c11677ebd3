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

static uint64_t proc_stat(uint32_t pid, char* state) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%u/stat", pid);
  int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[1024];
  ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = 0;
  // The command name (field 2) may contain spaces and parentheses: skip to the last ')'.
  char* p = std::strrchr(buf, ')');
  if (!p) return 0;
  p += 2;  // now at field 3 (state)
  if (state) *state = *p;
  for (int field = 3; field < 22 && *p; ++field) {
    p = std::strchr(p, ' ');
    if (!p) return 0;
    ++p;
  }
  return std::strtoull(p, nullptr, 10);
}

uint64_t proc_start_time(uint32_t pid) { return proc_stat(pid, nullptr); }

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
  g_self_start.store(proc_start_time(now), std::memory_order_relaxed);
  g_self_pid.store(now, std::memory_order_release);
  return ProcId{now, g_self_start.load(std::memory_order_relaxed)};
}

bool proc_alive(const ProcId& p) {
  if (p.pid == 0) return false;
  if (::kill(static_cast<pid_t>(p.pid), 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  uint64_t s = proc_stat(p.pid, &state);
  if (s == 0) return p.start == 0 && ::kill(static_cast<pid_t>(p.pid), 0) == 0;
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
