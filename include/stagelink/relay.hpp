// The relay: SGLang-Omni's asynchronous buffer API (seed 001) over stagelink's transports.
//
//   auto relay = Relay::create(cfg).value();
//   RelayOp put = relay->put_async(payload, {.request_id = "req-1", .edge = "talker"}).value();
//   send_control(put.metadata());        // the control message first ...
//   put.wait(5.0);                       // ... then, if needed, wait until the reader released it
//   // receiver:
//   RelayOp get = relay->get_async(metadata, {.request_id = "req-1"}).value();
//   get.wait(5.0); Payload& p = get.payload();
//
// Credits bound what one relay has in flight per edge (destination): a put takes one credit
// (however many tensors it holds) and gives it back when every reader has released the data,
// when the request is cleaned up, or when the relay closes; an operation dropped without a wait
// gives nothing back early and loses nothing (the data stays readable). Every credit wait has a
// deadline. Backends: `shm` (the shared-memory connector's arena, no segment per put), `local`
// (same process, payload by reference), or any connector by name (`connector`).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "stagelink/connector.hpp"

namespace stagelink {

struct RelayConfig {
  std::string backend = "shm";   // shm | local | connector (then `connector` names it)
  std::string connector;         // a connector class name, for backend "connector"
  Value extra;                   // the connector's `extra` (shm: ns, shm_dir, ttl_s, ...)
  double slot_size_mb = 16;      // the seed's slot: arena = slot_size_mb * credits (shm)
  uint32_t credits = 8;          // per edge: puts in flight to one destination
  // The seed's topology fields. world_size 0 (not given): any dst_rank >= 0 is an edge of its own,
  // as SGLang-Omni's shm relay takes one it does not use; given: dst_rank must be below it.
  int rank = 0, world_size = 0;
  std::string device = "cpu";
  double timeout_s = 30;         // credit waits and gets without their own timeout
  std::string engine_id;         // SGLang-Omni's sender name, carried in every put's metadata
  // Keys of the seed's RelayConfig (slot_size_mb, credits, rank, world_size, device) plus
  // backend, connector, extra, timeout_s, engine_id. Errors: invalid_argument naming the key.
  static Result<RelayConfig> from_value(const Value& v);
  // The connector this relay makes (its backend's, or `connector`); empty for `local`.
  std::string connector_name() const;
  // Whether its payloads stay within this host (local, or a host_local connector's): only such a
  // relay may carry CUDA device records.
  bool host_local() const;
};

// The relay's backends, the one place each is described: the connector it makes and where its
// data goes. `ucx` is read as `connector` with TransferEngineConnector; `connector` names its
// connector in the config (its traits are then the connector's, from its descriptor).
struct RelayBackend {
  std::string_view name;       // shm | ucx | local | connector
  std::string_view connector;  // the connector it makes ("" for local and connector)
  bool host_local;             // its payloads stay within this host
  std::string_view doc;
};
std::span<const RelayBackend> relay_backends();
// The relay config's schema (a closed one: every unknown key refused), for the reference.
const options::Schema& relay_schema();

struct RelayPutOptions {
  std::string_view request_id;     // cleanup(request_id) releases the put and its credit
  // A W3C traceparent (trace.hpp): sampled, a wait for a credit records a span "relay.credit_wait" and
  // the connector's put a span "connector.put" under it. Empty: none.
  std::string_view traceparent;
  std::optional<int> dst_rank;     // the seed's destination rank (an edge of its own)
  std::string_view edge;           // destination name (credits are per edge); empty: by dst_rank
  uint32_t readers = 1;            // fan-out: gets that may read it before it is released
  // Asked at least every 200 ms while the put waits for a credit; false ends it (cancelled). The
  // Python binding runs Python's signal handlers here (Ctrl-C).
  std::function<bool()> keep_waiting;
  // The `local` backend only: an object of the caller's passed by reference instead of the
  // payload (the Python binding puts its objects so), handed to the gets (RelayOp::object) and
  // dropped when the last reader took it, the put is withdrawn or the relay closes; never while
  // the relay holds a lock, so its deleter may take one of the caller's (Python's GIL).
  // `object_bytes`: the size its metadata reports (transfer_info.size).
  std::shared_ptr<const void> object;
  size_t object_bytes = 0;
  // Backends over a connector that keeps device slots (device_slots() > 0): what the put's entry
  // keeps until every reader released it (PutHooks::hold: the slots of CUDA tensors left on their
  // GPU, whose records the payload carries). `data_bytes` (> 0): the bytes the data holds, for
  // transfer_info.size, where the payload's tensors are such records. The metadata then says
  // "cuda_ipc": true.
  std::shared_ptr<const void> hold;
  std::optional<size_t> data_bytes;
};

struct RelayGetOptions {
  std::string_view request_id;
  std::span<std::byte> dest;       // copy the payload's single tensor here (one memcpy); empty: none
  bool zero_copy = false;          // tensors are views holding the slot until dropped
  double timeout_s = -1;           // < 0: the relay's timeout_s
  std::function<bool()> keep_waiting;  // passed to the connector's get (GetOptions::keep_waiting)
  bool private_ok = false;  // with zero_copy: GetOptions::private_ok (RelayOp::owned says the outcome)
  std::string_view traceparent;  // sampled: the connector's get records a span under it (trace.hpp)
};

// One piece of a put_segments payload: `data` written at byte `offset` of its one uint8 tensor.
struct RelaySegment {
  size_t offset = 0;
  std::span<const std::byte> data;
};

class RelayCore;

// A put or get in flight. Move-only; dropping it loses nothing (see above).
class RelayOp {
 public:
  struct State;
  RelayOp();
  explicit RelayOp(std::shared_ptr<State> s);
  RelayOp(RelayOp&&) noexcept;
  RelayOp& operator=(RelayOp&&) noexcept;
  ~RelayOp();
  // What the receiver's get_async needs (put), or what it was given (get).
  const Value& metadata() const;
  // Put: until every reader released the data (the credit is back). Get: the data is here.
  // timeout_s < 0: forever. Errors: timeout, cancelled (cleanup/close before it was read).
  Status wait(double timeout_s);
  bool done();
  // Put: withdraw it while unread (its reader failed): its slot and credit come back and a wait
  // ends cancelled. Returns whether it was withdrawn (false: already read, gone, or a get).
  bool withdraw();
  // Get: the payload (empty for a put), its frame size, and bytes copied into dest.
  Payload& payload();
  size_t size() const;
  // Get: the payload's memory is this get's alone (GetResult::owned).
  bool owned() const;
  // Get: the object a `local` put passed by reference (RelayPutOptions::object); null otherwise.
  const std::shared_ptr<const void>& object() const;

 private:
  std::shared_ptr<State> s_;
};

class Relay {
 public:
  // Errors: invalid_argument (config), those of the backend's connector.
  static Result<std::unique_ptr<Relay>> create(const RelayConfig& cfg);
  ~Relay();
  const RelayConfig& config() const;

  // Publish `payload` for one destination. Waits for a credit of the edge up to timeout_s.
  // Errors: exhausted (no credit in time, naming the edge and what holds its credits),
  // invalid_argument, closed, the connector's.
  Result<RelayOp> put_async(const Payload& payload, const RelayPutOptions& opts = {});
  // SGLang-Omni's put_many_async: a payload of one uint8 tensor of `total` bytes with `segments`
  // written at their offsets (zeros between), straight into the relay's shared memory (one copy,
  // into a loan; where the connector lends no memory, one owned buffer). Errors: as put_async,
  // and invalid_argument for a segment that overlaps another or ends past `total`.
  Result<RelayOp> put_segments(std::span<const RelaySegment> segments, size_t total,
                               const RelayPutOptions& opts = {});
  // Read what put_async published, given its metadata (from the control message). Errors:
  // invalid_argument (dest too small, several tensors for one dest), corrupt (metadata),
  // timeout, cancelled, closed.
  Result<RelayOp> get_async(const Value& metadata, const RelayGetOptions& opts = {});
  // Where another process's relay of the same backend reaches this one's puts (a transfer
  // engine's source_host and source_port); nil where nothing needs connecting (shared memory).
  Value sender_info();
  // Each device arena's size where the backend's connector keeps device slots for CUDA tensors
  // (the shared-memory connector with cuda_ipc on); 0 otherwise.
  size_t device_slots() const;
  // Connect ahead of the first get to the relay `sender_info` describes (its sender_info(), or a
  // put's metadata), so that first get costs what the next ones do; within `timeout_s` (negative:
  // the relay's timeout_s). Nothing to do for shared memory. Errors: the connector's connect.
  Status connect(const Value& sender_info, double timeout_s = -1);
  // Withdraw this relay's unread puts of `request_id` (their slots and credits come back, their
  // waits end cancelled); returns how many. Other relays' puts of the request, in this process
  // or another, are theirs to clean up.
  size_t cleanup(const std::string& request_id);
  // Counters and per-edge credits in use.
  Value health();
  // Releases everything; pending credit waits end with `closed`. Idempotent.
  void close();

 private:
  explicit Relay(std::shared_ptr<RelayCore> core);
  std::shared_ptr<RelayCore> core_;
};

}  // namespace stagelink
