// Names that come from outside (keys, stage ids), checked before any connector uses them, and
// the internal key vLLM-Omni builds from them. Internal: connectors and tests.
#pragma once
#include <string>
#include <string_view>

#include "stagelink/result.hpp"

namespace stagelink {

// Internal key, as in vLLM-Omni: f"{key}@{from_stage}_{to_stage}".
std::string make_internal_key(const std::string& key, const std::string& from_stage,
                              const std::string& to_stage);
// Keys and names that come from outside: 1..max_len chars, no '/', no "..", no NUL/control.
Status validate_name(std::string_view what, std::string_view s, size_t max_len);
// The check alone, without building an error (hot paths call validate_name only when it fails).
namespace detail {
// Per byte: 1 = never allowed in a name (control characters, DEL, '/'), 2 = '.'.
inline constexpr auto kNameClass = [] {
  struct Table {
    unsigned char v[256] = {};
  } t;
  for (int c = 0; c < 0x20; ++c) t.v[c] = 1;
  t.v[0x7f] = 1;
  t.v[static_cast<unsigned char>('/')] = 1;
  t.v[static_cast<unsigned char>('.')] = 2;
  return t;
}();
}  // namespace detail
inline bool name_is_valid(std::string_view s, size_t max_len) noexcept {
  if (s.empty() || s.size() > max_len) return false;
  // One pass, no early exit: a forbidden byte, or '.' right after '.'.
  unsigned bad = 0, prev = 0;
  for (char ch : s) {
    const unsigned k = detail::kNameClass.v[static_cast<unsigned char>(ch)];
    bad |= (k & 1) | (k & prev);
    prev = k & 2;
  }
  return bad == 0;
}

}  // namespace stagelink
