// libFuzzer: the frame decoder (every payload a peer hands over: shared memory, UCX, the store,
// message queues). Any input is an error or a payload whose every view lies inside the input.
#include <cstdint>
#include <cstring>

#include "stagelink/frame.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> in(reinterpret_cast<const std::byte*>(data), size);
  auto p = stagelink::decode_frame(in);
  if (p.ok()) {
    for (const auto& t : p->tensors) {
      if (t.data.size() && (t.data.data() < in.data() || t.data.data() + t.data.size() > in.data() + in.size()))
        __builtin_trap();  // a view outside the buffer
      volatile std::byte sink{};
      for (auto b : t.data) sink = b;  // ASan checks every byte is readable
    }
  }
  auto c = stagelink::decode_frame_copy(in);
  if (p.ok() != c.ok()) __builtin_trap();  // the two decoders must agree
  stagelink::Payload out;
  (void)stagelink::decode_frame_into(in, nullptr, out, false);
  return 0;
}
