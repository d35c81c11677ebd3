// Minimal leveled logging to stderr. Level from STAGELINK_LOG (error, warn, info, debug), read once.
#pragma once
#include <cstdarg>

namespace stagelink::log {
enum class Level { error = 0, warn = 1, info = 2, debug = 3 };
bool enabled(Level l);
void write(Level l, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
}  // namespace stagelink::log

#define SL_LOG_WARN(...) ::stagelink::log::write(::stagelink::log::Level::warn, __VA_ARGS__)
#define SL_LOG_ERROR(...) ::stagelink::log::write(::stagelink::log::Level::error, __VA_ARGS__)
#define SL_LOG_INFO(...)                                                                   \
  do {                                                                                     \
    if (::stagelink::log::enabled(::stagelink::log::Level::info))                          \
      ::stagelink::log::write(::stagelink::log::Level::info, __VA_ARGS__);                 \
  } while (0)
#define SL_LOG_DEBUG(...)                                                                  \
  do {                                                                                     \
    if (::stagelink::log::enabled(::stagelink::log::Level::debug))                         \
      ::stagelink::log::write(::stagelink::log::Level::debug, __VA_ARGS__);                \
  } while (0)
