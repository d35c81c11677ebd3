// libFuzzer: a shared-memory get given metadata (msgpack here) that no put of ours wrote: it is an
// error or a miss, never a read of another entry's or arena's bytes.
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <string>

#include "stagelink/stagelink.hpp"

namespace {
std::unique_ptr<stagelink::Connector> g_conn;  // closed at exit: the namespace leaves /dev/shm

stagelink::Connector& conn() {
  if (!g_conn) {
    stagelink::Value::Map m;
    m.emplace_back("namespace", "fuzz" + std::to_string(getpid()));
    m.emplace_back("arena_bytes", uint64_t(1) << 20);
    g_conn = std::move(stagelink::create_connector("SharedMemoryConnector", stagelink::Value(std::move(m))).value());
    std::vector<std::byte> bytes(3000, std::byte{7});
    for (int i = 0; i < 4; ++i) {
      stagelink::Payload p;
      p.tree = stagelink::Value(stagelink::TensorRef{0});
      p.tensors.push_back(stagelink::Tensor::view_of(std::span<const std::byte>(bytes)));
      (void)g_conn->put("0", "1", "k" + std::to_string(i), p);
    }
    std::atexit([] { g_conn.reset(); });
  }
  return *g_conn;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto md = stagelink::value_from_msgpack(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  if (!md.ok()) return 0;
  const stagelink::Value* m = md->find("md");  // a data_ready's metadata, as the seeds hold it
  auto g = conn().get("0", "1", "zz", m ? m : &md.value(), stagelink::kNoWait);
  if (g.ok()) {
    volatile std::byte sink{};
    for (const auto& t : g->payload.tensors)
      for (auto b : t.data) sink = b;
  }
  return 0;
}
