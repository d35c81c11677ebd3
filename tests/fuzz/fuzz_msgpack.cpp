// libFuzzer: the msgpack reader (metadata, side-channel requests, handles) and its re-encoding.
#include <cstdint>

#include "stagelink/payload.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto v = stagelink::value_from_msgpack(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  if (v.ok()) {
    // What decodes re-encodes, and decodes to the same value (compared as bytes: NaN != NaN).
    auto bytes = stagelink::value_to_msgpack(v.value());
    auto again = stagelink::value_from_msgpack(bytes);
    if (!again.ok() || stagelink::value_to_msgpack(again.value()) != bytes) __builtin_trap();
  }
  return 0;
}
