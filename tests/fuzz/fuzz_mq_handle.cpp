// libFuzzer: message-queue handles (they travel between hosts, e.g. through torch.distributed).
#include <cstdint>

#include "stagelink/mq.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto h = stagelink::MessageQueueHandle::from_msgpack(
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  if (h.ok()) {
    auto again = stagelink::MessageQueueHandle::from_msgpack(h->to_msgpack());
    if (!again.ok() || again->remote_addr != h->remote_addr || again->ring_name != h->ring_name) __builtin_trap();
  }
  return 0;
}
