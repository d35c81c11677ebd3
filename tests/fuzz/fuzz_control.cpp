// libFuzzer: control messages (what any peer of a control inbox may send).
#include <cstdint>

#include "stagelink/control.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto m = stagelink::decode_control(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  if (m.ok()) {
    auto bytes = stagelink::encode_control(m.value());  // a decoded message is within the limits
    if (!bytes.ok()) __builtin_trap();
    auto again = stagelink::decode_control(bytes.value());
    if (!again.ok() || stagelink::encode_control(again.value()).value() != bytes.value()) __builtin_trap();
  }
  return 0;
}
