// Control-plane messages of the pipeline runtime (SGLang-Omni's design, seed 001): what the
// coordinator and stages tell each other beside the data plane. One small msgpack map per message;
// decoding checks every field's presence, type and size (a malformed message is an error, never a
// crash or a half-filled message).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "stagelink/curve.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink {

enum class ControlType : uint8_t {
  submit = 0,    // coordinator -> entry stage: a new request (its payload in `body` or by relay)
  data_ready,    // stage -> stage: a payload (or a stream chunk) is in the relay; `metadata` locates it
  data_ack,      // receiver -> sender: the transfer named by `metadata` was read (credit returns)
  complete,      // terminal stage -> coordinator: the request's result (`body`) or its `error`
  stream,        // stage -> stage or coordinator: a stream chunk (`chunk_id`), or its end (`is_done`)
  shutdown,      // coordinator -> stage: stop after in-flight work
  abort,         // coordinator -> every stage: drop everything of `request_id`
  abort_ack,     // stage -> coordinator: the abort of `request_id` is done here
  ready,         // stage process -> coordinator: started (`metadata`: its endpoint and relay
                 // senders), or `error`: why it could not
  // The runtime's own lifecycle (stagelink's; SGLang-Omni's nine above are unchanged). None of
  // them, nor shutdown and ready, carries a request id. python/stagelink/pipeline/protocol.py
  // gives each its typed fields.
  progress,      // stage process -> coordinator: which stage it is building, what that imports
  peers,         // coordinator -> stage process: every process's control endpoint
  peers_known,   // stage process -> coordinator: it has them
  connect,       // coordinator -> stage process: connect these relays to their senders now
  connected,     // stage process -> coordinator: done (`metadata`: the edges it could not connect)
  stats,         // stage process -> coordinator, at shutdown: its figures in `body`
  launch,        // launcher -> the agent that starts a stage process on another node (a Ray
                 // actor): the process's spec and secrets in `body`, over CURVE
  metrics_ask,   // coordinator -> stage process: send your metrics (`metadata`: seq), a scrape
  metrics,       // stage process -> coordinator: its metrics tree's samples in `body`
  trace,         // coordinator -> stage process: send your trace spans (`metadata`: seq, clock);
                 // stage process -> coordinator: its spans in `body` and its clock readings
};
inline constexpr int kControlTypeCount = 19;
// Whether messages of type `t` belong to a request (and so must name one).
constexpr bool control_type_has_request(ControlType t) noexcept {
  return t != ControlType::shutdown && t < ControlType::ready;
}
const char* control_type_name(ControlType t) noexcept;
Result<ControlType> control_type_from_name(std::string_view name);

struct ControlMessage {
  ControlType type = ControlType::submit;
  std::string request_id;             // required where control_type_has_request
  std::string from_stage, to_stage;   // empty: not applicable
  Value metadata;                     // relay metadata (data_ready, data_ack, stream); nil: none
  std::optional<uint64_t> chunk_id;   // stream chunks: their number per (request, target)
  bool is_done = false;               // stream: the last signal of the stream
  std::string error;                  // empty: none; else what failed (complete, stream)
  std::vector<std::byte> body;        // small inline payload (a frame), e.g. submit and complete
  // A W3C traceparent (trace.hpp) when the request is traced: the span that sent this message.
  // An encoder refuses a malformed one; a decoder drops it (W3C: a receiver ignores it).
  std::string traceparent;

  bool operator==(const ControlMessage&) const = default;
};

// Limits a decoder enforces (and an encoder refuses to exceed).
inline constexpr size_t kControlMaxId = 256;          // request and stage ids
inline constexpr size_t kControlMaxError = 64u << 10; // error text (a traceback)
inline constexpr size_t kControlMaxBody = 64u << 20;  // inline body
// The largest encoded message a control inbox accepts: the body and error at their limits plus
// 1 MiB for ids and metadata.
inline constexpr size_t kControlMaxWire = kControlMaxBody + kControlMaxError + (1u << 20);
// Over ZeroMQ a message travels in parts of at most this many bytes: the frame cap
// (ZMQ_MAXMSGSIZE) of a control inbox, which bounds what one connection that has not (yet)
// authenticated can make it buffer; at most kControlMaxConnections connections are let in.
inline constexpr size_t kControlPartBytes = 128u << 10;
inline constexpr size_t kCurveFrameOverhead = 256;  // a CURVE MESSAGE command around a part
inline constexpr size_t kControlMaxConnections = 256;

// Errors: invalid_argument (a field out of its limits, a missing request id).
Result<std::vector<std::byte>> encode_control(const ControlMessage& m);
// Errors: corrupt, naming the field and what was wrong with it.
Result<ControlMessage> decode_control(std::span<const std::byte> bytes);

// ---- Transport: ZeroMQ PUSH/PULL ----
// Each stage and the coordinator own one inbox (PULL, bound); senders hold an outbox (PUSH,
// connected) per destination. On one host endpoints are `ipc://` sockets in a private directory
// of the pipeline (0700, removed by close()), so two pipelines never collide; across hosts
// `tcp://host:port`. Every wait has a deadline; an idle inbox sleeps in the kernel.

// A new private directory for a pipeline's sockets: 0700, under $XDG_RUNTIME_DIR when set, else
// /tmp. Errors: io.
Result<std::string> make_private_socket_dir(const std::string& tag = "stagelink");
// Remove a directory made by make_private_socket_dir and the sockets in it (best effort).
void remove_private_socket_dir(const std::string& dir);

class ControlInbox {
 public:
  // Bind `endpoint` ("ipc:///path" or "tcp://host:port"; port 0: any free port). With `curve`
  // (ZeroMQ endpoints), only clients with a listed key connect, and every message is encrypted;
  // a tcp endpoint off loopback without it is logged once, loudly.
  // Errors: invalid_argument (bad endpoint or keys), io (taken: the message names it),
  // unsupported (CURVE asked of a libzmq without it).
  static Result<std::unique_ptr<ControlInbox>> bind(const std::string& endpoint, const CurveServer* curve = nullptr);
  virtual ~ControlInbox() = default;
  // The endpoint peers connect to (a tcp port chosen by the kernel filled in).
  virtual const std::string& endpoint() const = 0;
  // The next message. timeout_s < 0: wait forever; 0: one attempt. Errors: timeout, closed,
  // corrupt (a malformed message: it is dropped and the inbox stays usable).
  virtual Result<ControlMessage> recv(double timeout_s) = 0;
  // Wake a blocked recv (it returns `closed`) and release the socket. Idempotent.
  virtual void close() = 0;
  // Peers refused: at the CURVE handshake (a key not allowed, or no CURVE at all), or connections
  // shut down over the inbox's limit (core/zmq_guard.hpp).
  virtual uint64_t refused() const { return 0; }
  // Whether the inbox authenticates its peers (CURVE), or needs none (shm://, ipc:// in a 0700
  // directory).
  virtual bool authenticated() const { return true; }
};

class ControlOutbox {
 public:
  // With `curve` (ZeroMQ endpoints): this end's keys and the inbox's public key.
  static Result<std::unique_ptr<ControlOutbox>> connect(const std::string& endpoint, const CurveClient* curve = nullptr);
  virtual ~ControlOutbox() = default;
  // Queue `m` for the inbox (encoded, then send_bytes). Blocks while the peer's queue is full, up
  // to timeout_s (< 0: forever). Errors: invalid_argument (a field over its limit), timeout (the
  // peer takes nothing), closed.
  Status send(const ControlMessage& m, double timeout_s) {
    SL_ASSIGN(auto bytes, encode_control(m));
    return send_bytes(bytes, timeout_s);
  }
  // Raw bytes, for tests of a peer that sends garbage.
  virtual Status send_bytes(std::span<const std::byte> bytes, double timeout_s) = 0;
  // Delivers what is queued (waiting at most 1 s for a peer that takes nothing), then releases
  // the socket. Idempotent; also run by the destructor.
  virtual void close() = 0;
};

}  // namespace stagelink
