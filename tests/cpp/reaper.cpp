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

class ReapChildren : public testing::EmptyTestEventListener {
  void OnTestEnd(const testing::TestInfo& t) override {
    const auto kids = live_children();
    if (kids.empty()) return;
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
