#include "core/proc.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

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

ProcId self_proc() {
  static thread_local ProcId cached{};
  uint32_t pid = static_cast<uint32_t>(::getpid());
  if (cached.pid != pid) cached = ProcId{pid, proc_start_time(pid)};  // refreshed after fork
  return cached;
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
