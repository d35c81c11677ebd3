// Every test leaves the processes as it found them: a test whose ASSERT returned before it waited
// for (or killed) a child it forked would otherwise leave that child running after the suite, or
// hung for ever (a child of a failed run was found so, 5 minutes on). After each test, whatever
// children the test process still has are killed and reaped, and named on stderr.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

std::vector<pid_t> live_children() {  // zombies included: they are reaped too
  std::vector<pid_t> out;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task", ec)) {
    std::ifstream f(t.path() / "children");
    for (pid_t p; f >> p;) out.push_back(p);
  }
  return out;
}

std::string read_file(const std::filesystem::path& p, size_t max = 4096) {
  std::ifstream f(p);
  std::string s(max, '\0');
  f.read(s.data(), std::streamsize(max));
  s.resize(size_t(f.gcount()));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

// Where each thread of a child that outlived a failed test is waiting (its name, state, kernel
// wait channel, system call and, where readable, kernel stack): a hung child says why it hung.
void describe(pid_t pid) {
  std::error_code ec;
  const std::filesystem::path proc = "/proc/" + std::to_string(pid);
  for (const auto& t : std::filesystem::directory_iterator(proc / "task", ec)) {
    const std::string stat = read_file(t.path() / "stat");
    const size_t close = stat.rfind(')');
    const char state = close != std::string::npos && close + 2 < stat.size() ? stat[close + 2] : '?';
    std::string stack = read_file(t.path() / "stack", 1024);
    for (auto& c : stack)
      if (c == '\n') c = '|';
    std::fprintf(stderr, "[reaper]   pid %d tid %s (%s) state %c wchan %s syscall %s%s%s\n", int(pid),
                 t.path().filename().c_str(), read_file(t.path() / "comm").c_str(), state,
                 read_file(t.path() / "wchan").c_str(), read_file(t.path() / "syscall").c_str(),
                 stack.empty() ? "" : " stack ", stack.c_str());
  }
}

class ReapChildren : public testing::EmptyTestEventListener {
  void OnTestEnd(const testing::TestInfo& t) override {
    const auto kids = live_children();
    if (kids.empty()) return;
    if (t.result() && t.result()->Failed())
      for (pid_t p : kids) describe(p);
    for (pid_t p : kids) ::kill(p, SIGKILL);
    for (pid_t p : kids) ::waitpid(p, nullptr, 0);
    std::fprintf(stderr, "[reaper] %s.%s left %zu child process(es) behind: killed and reaped\n", t.test_suite_name(),
                 t.name(), kids.size());
  }
};

[[maybe_unused]] const bool registered = [] {
  testing::UnitTest::GetInstance()->listeners().Append(new ReapChildren);
  return true;
}();

}  // namespace
