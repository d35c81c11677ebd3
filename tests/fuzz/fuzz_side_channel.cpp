// libFuzzer: the transfer engine's side channel, as any peer that reaches it may talk to it (no
// CURVE): each input is one request frame sent to a live sender; the sender must answer with a
// well-formed reply (or drop the request), never crash, and go on serving.
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <zmq.hpp>

#include "stagelink/stagelink.hpp"

namespace {
struct Peer {
  std::unique_ptr<stagelink::Connector> sender;
  zmq::context_t ctx{1};
  zmq::socket_t dealer{ctx, zmq::socket_type::dealer};
};
Peer* g = nullptr;

Peer& peer() {
  if (!g) {
    g = new Peer();
    stagelink::Value::Map m;
    m.emplace_back("host", "127.0.0.1");
    m.emplace_back("zmq_port", uint64_t(0));
    m.emplace_back("role", "sender");
    m.emplace_back("memory_pool_size", uint64_t(8) << 20);
    m.emplace_back("timeout_s", 0.5);
    g->sender = std::move(stagelink::create_connector("TransferEngineConnector", stagelink::Value(std::move(m))).value());
    std::vector<std::byte> bytes(3000, std::byte{5});
    for (int i = 0; i < 3; ++i) {
      stagelink::Payload p;
      p.tree = stagelink::Value(stagelink::TensorRef{0});
      p.tensors.push_back(stagelink::Tensor::view_of(std::span<const std::byte>(bytes)));
      stagelink::PutOptions po;
      po.readers = 1000;  // stays for the whole run
      (void)g->sender->put("0", "1", "k" + std::to_string(i), p, po);
    }
    uint64_t port = 0;
    g->sender->capability<stagelink::SenderLink>()->sender_info().find("source_port")->get_u64(port);
    g->dealer.set(zmq::sockopt::linger, 0);
    g->dealer.set(zmq::sockopt::rcvtimeo, 3000);
    g->dealer.connect("tcp://127.0.0.1:" + std::to_string(port));
    std::atexit([] {
      g->dealer.close();
      g->sender->close();
    });
  }
  return *g;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Peer& p = peer();
  p.dealer.send(zmq::const_buffer(data, size), zmq::send_flags::none);
  // Malformed and unknown requests are answered too; a reply, when there is one, is well formed.
  // (libFuzzer's timers interrupt the wait now and then: EINTR is waited through.)
  zmq::message_t rep;
  bool got = false;
  for (;;) {
    try {
      got = bool(p.dealer.recv(rep));
      break;
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;
    }
  }
  if (got) {
    auto v = stagelink::value_from_msgpack(std::span<const std::byte>(static_cast<const std::byte*>(rep.data()), rep.size()));
    if (!v.ok() || !v->find("ok")) __builtin_trap();
  }
  return 0;
}
