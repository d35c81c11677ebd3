// vLLM-Omni's internal key, f"{key}@{from_stage}_{to_stage}", written in one place: by
// make_internal_key into a string, by the shared-memory connector into a stack buffer.
#pragma once
#include <cstring>
#include <string_view>

namespace stagelink {

inline size_t internal_key_size(std::string_view key, std::string_view from, std::string_view to) {
  return key.size() + from.size() + to.size() + 2;
}

// Writes internal_key_size(key, from, to) bytes to dst.
inline void write_internal_key(char* dst, std::string_view key, std::string_view from, std::string_view to) {
  std::memcpy(dst, key.data(), key.size());
  dst += key.size();
  *dst++ = '@';
  std::memcpy(dst, from.data(), from.size());
  dst += from.size();
  *dst++ = '_';
  std::memcpy(dst, to.data(), to.size());
}

}  // namespace stagelink
