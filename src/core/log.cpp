#include "core/log.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace stagelink::log {
namespace {
Level read_level() {
  const char* s = std::getenv("STAGELINK_LOG");
  if (!s) return Level::warn;
  if (!std::strcmp(s, "error")) return Level::error;
  if (!std::strcmp(s, "info")) return Level::info;
  if (!std::strcmp(s, "debug")) return Level::debug;
  return Level::warn;
}
const Level g_level = read_level();
const char* names[] = {"error", "warn", "info", "debug"};
}  // namespace

bool enabled(Level l) { return static_cast<int>(l) <= static_cast<int>(g_level); }

void write(Level l, const char* fmt, ...) {
  if (!enabled(l)) return;
  char buf[1024];
  int n = std::snprintf(buf, sizeof buf, "[stagelink %s pid=%d] ", names[static_cast<int>(l)],
                        static_cast<int>(getpid()));
  va_list ap;
  va_start(ap, fmt);
  int m = std::vsnprintf(buf + n, sizeof buf - n - 2, fmt, ap);
  va_end(ap);
  size_t len = n + (m < 0 ? 0 : std::min<size_t>(m, sizeof buf - n - 3));
  buf[len++] = '\n';
  ssize_t w = ::write(2, buf, len);
  (void)w;
}
}  // namespace stagelink::log
