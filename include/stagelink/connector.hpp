// The connector API: put/get/cleanup/health/close by key, the contract of vLLM-Omni's
// OmniConnector, in C++. Connectors are created by class name through the factory.
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "stagelink/frame.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
// `seconds` from now: for ever (Deadline::max()) when infinite, NaN or 1e9 s and more, whose
// nanoseconds would overflow; now for a negative one.
inline Deadline deadline_after(double seconds) {
  if (!(seconds < 1e9)) return Deadline::max();
  if (!(seconds > 0)) return Clock::now();
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}
inline constexpr Deadline kNoWait = Deadline::min();
// `d` plus `by`, saturating at Deadline::max() (for ever stays for ever, never wraps around).
inline Deadline later(Deadline d, Clock::duration by) {
  return d > Deadline::max() - by ? Deadline::max() : d + by;
}

struct PutOptions {
  uint32_t readers = 0;  // fan-out: how many gets may read this put; 0 = connector default (1)
  // The request this put belongs to: cleanup(request_id) frees it (chunk keys of one request are
  // tied to it this way). Empty: the put belongs to the request named by its key alone.
  std::string_view request_id;
  // Called, before put returns, with the frame of a put that travels inline in its metadata
  // (the shared-memory connector's "inline", frames up to shm_threshold_bytes), which then leaves
  // "inline" out of PutResult::metadata: the caller adds it where it builds its own metadata (the
  // Python binding makes the bytes object straight from the frame, without a copy into a Value
  // first). Called under the connector's lock: it must not call back into the connector. Other
  // connectors never call it.
  std::function<void(std::span<const std::byte>)> inline_sink;
};

struct PutResult {
  size_t size = 0;  // serialized frame bytes
  Value metadata;   // small msgpack-able map for the control plane
};

struct GetOptions {
  // true: tensors are views into the transport's memory and keep the slot alive until dropped.
  // false: the payload owns a copy and the slot is released before get returns.
  bool zero_copy = false;
  // With zero_copy: a payload that travelled inline in `metadata` may be returned as views of the
  // metadata's bytes (no copy, no keepalive); the caller keeps the metadata alive and unchanged
  // while it uses them. Bindings that copy the result out at once use it.
  bool view_metadata = false;
  // With zero_copy: leave the tree as msgpack bytes in Payload::packed_tree (valid while the
  // tensors are) instead of building it; for bindings that build their own objects from it.
  bool raw_tree = false;
  // The inline frame of `metadata` when the caller left it out of the Value (its "inline" field):
  // read in place, the memory held by the caller for the call (the Python binding points it at
  // the metadata's bytes object instead of copying them into the Value). Empty: none.
  std::span<const std::byte> metadata_inline;
  // Asked on the getting thread at least every kWaitCheckEvery while the get waits for its key to be
  // put (never during a transfer: a payload found is always read whole); false ends the get with
  // Errc::cancelled. The Python binding runs Python's signal handlers here, so Ctrl-C ends a long
  // get. Empty: the get waits until its deadline.
  std::function<bool()> keep_waiting;
  // With zero_copy, for a caller that would copy the result out at once (the Python binding's
  // default get): a connector that can land the payload straight in memory of this process that
  // no one else writes (a host buffer of its own, not shared memory nor a pool region) may do so
  // and say GetResult::owned. The transfer engine does, from 1 MiB: no copy after the transfer.
  bool private_ok = false;
};
inline constexpr std::chrono::milliseconds kWaitCheckEvery{200};
// The end of the next stretch of a wait that ends at `deadline`: `deadline`, or sooner when there
// is a keep_waiting to ask (GetOptions', RelayPutOptions').
inline Deadline wait_slice_end(Deadline deadline, const std::function<bool()>& keep_waiting) {
  return keep_waiting ? std::min(deadline, later(Clock::now(), kWaitCheckEvery)) : deadline;
}

struct GetResult {
  Payload payload;
  size_t size = 0;
  // The tensors view memory this get alone holds (their keepalive): the caller may hand them out
  // writable instead of copying them (GetOptions::private_ok).
  bool owned = false;
};

// A writable reservation in the transport's memory (write tensors in place, then publish).
// Dropping an unpublished loan returns its memory. A loan may outlive its connector: its region
// stays writable and dropping it then frees what is left (nothing leaks, nothing dangles).
class Loan {
 public:
  struct Impl;
  Loan();
  explicit Loan(std::unique_ptr<Impl> impl);
  Loan(Loan&&) noexcept;
  Loan& operator=(Loan&&) noexcept;
  ~Loan();
  bool valid() const { return impl_ != nullptr; }
  size_t tensor_count() const;
  // Writable bytes of tensor region i.
  std::span<std::byte> region(size_t i);
  size_t frame_size() const;
  Impl* impl() { return impl_.get(); }
  std::unique_ptr<Impl> release_impl();


 private:
  std::unique_ptr<Impl> impl_;
};

class Connector {
 public:
  virtual ~Connector() = default;
  virtual const std::string& name() const = 0;

  // Publish `payload` under key@from_to. Errors: invalid_argument (bad key), exists (key still
  // being read), exhausted (no room before the put timeout), closed, io.
  virtual Result<PutResult> put(const std::string& from_stage, const std::string& to_stage,
                                const std::string& key, const Payload& payload,
                                const PutOptions& opts = {}) = 0;

  // Fetch key@from_to. With metadata from put(), locate it directly; without, find it by key,
  // waiting until `deadline` (kNoWait: one attempt). Blocks in the kernel, never polls.
  // Metadata this connector cannot use (another connector's, empty, not a map) is ignored: the key
  // is looked up as without it; metadata wrapped as {key: metadata} is unwrapped. Metadata that
  // is this connector's but inconsistent (another key, a generation never issued, out of bounds)
  // is `corrupt`, never another payload.
  // Errors: not_found (absent, after one attempt), timeout, cancelled (abandon_get, close),
  // corrupt (bad metadata/frame), closed.
  virtual Result<GetResult> get(const std::string& from_stage, const std::string& to_stage,
                                const std::string& key, const Value* metadata,
                                Deadline deadline = kNoWait, const GetOptions& opts = {}) = 0;

  // Zero-copy producer path: reserve room for a frame with these tensors; write them; publish.
  virtual Result<Loan> loan(const Value& tree, std::span<const TensorSpec> specs) {
    (void)tree; (void)specs;
    return make_error(Errc::unsupported, name() + " does not lend buffers");
  }
  virtual Result<PutResult> put_loan(const std::string& from_stage, const std::string& to_stage,
                                     const std::string& key, Loan&& loan,
                                     const PutOptions& opts = {}) {
    (void)from_stage; (void)to_stage; (void)key; (void)loan; (void)opts;
    return make_error(Errc::unsupported, name() + " does not lend buffers");
  }

  // Free every unread put of this request: the put whose key equals request_id and the puts tied
  // to it with PutOptions::request_id. Nothing else ("X" never frees "X_1" unless tied to "X").
  // Returns how many entries were released.
  virtual size_t cleanup(const std::string& request_id) = 0;
  // Wake every get of `key` (any stages) blocked in this connector; they return `cancelled`.
  // Returns how many were woken.
  virtual size_t abandon_get(const std::string& key) { (void)key; return 0; }
  // Return the memory of puts every reader has released (also done lazily by put). Returns how
  // many puts were reclaimed.
  virtual size_t reap_consumed() { return 0; }
  // Relay support (credits): whether every reader of the put `put_metadata` describes released
  // it (or it was cancelled, expired or reclaimed). Errors: unsupported (this connector cannot
  // tell), corrupt (metadata that is not this connector's put metadata).
  virtual Result<bool> put_released(const Value& put_metadata) {
    (void)put_metadata;
    return make_error(Errc::unsupported, name() + " does not report releases");
  }
  // A counter that moves whenever some put may have been released, and a wait (in the kernel)
  // until it moves past `seen` or `deadline` passes. Returns false on the deadline.
  virtual uint64_t release_epoch() { return 0; }
  virtual bool wait_release_epoch(uint64_t seen, Deadline deadline) { (void)seen; (void)deadline; return false; }
  // Arrival wake-ups (vLLM-Omni's get_wakeup_generation/wait_for_change): a counter that moves
  // when a put may have arrived, and a wait (in the kernel) until it moves past `seen` or
  // `deadline` passes; returns whether it moved. Hints: a receiver still gets its key by get.
  // Errors: unsupported (this connector cannot tell; callers keep a timed poll).
  virtual Result<uint64_t> arrival_epoch() {
    return make_error(Errc::unsupported, name() + " does not signal arrivals");
  }
  virtual bool wait_arrival(uint64_t seen, Deadline deadline) { (void)seen; (void)deadline; return false; }
  // The keys of this connector's puts that a reader may still get (vLLM-Omni's _pending_keys),
  // oldest first. Errors: unsupported (this connector does not track them).
  virtual Result<std::vector<std::string>> pending_keys() {
    return make_error(Errc::unsupported, name() + " does not list pending keys");
  }
  // Transfer engines: where a get without metadata finds the sender (vLLM-Omni's
  // update_sender_info(sender_host, sender_zmq_port)). Errors: unsupported, invalid_argument.
  virtual Status update_sender_info(const std::string& host, int port) {
    (void)host; (void)port;
    return make_error(Errc::unsupported, name() + " has no sender to update");
  }
  // Where a receiver reaches this connector's puts, as the keys its put metadata carries (a
  // transfer engine's source_host and source_port); nil for a connector nothing connects to (shared
  // memory, the store) or one that cannot put.
  virtual Value sender_info() { return Value(); }
  // Set up ahead of the first get what a get from the sender `sender_info` describes (those keys,
  // or a whole put's metadata; nil: the sender given by update_sender_info or the config) would
  // otherwise set up on first use: connections, endpoints, on both sides. The first get then costs
  // what the next ones do. Connectors with nothing to connect return ok. Errors: timeout, io,
  // peer_dead, not_found (no sender known), corrupt (an info that is not this connector's).
  virtual Status connect(const Value& sender_info, Deadline deadline) {
    (void)sender_info; (void)deadline;
    return {};
  }
  // Counters (puts, gets, bytes_transferred, errors, timeouts, ...) and transport state.
  virtual Value health() = 0;
  // Release everything this connector owns. Idempotent; also run by the destructor.
  virtual void close() = 0;
};

// Copy tensor `tensor` of key@from_to straight into `dst` (caller-owned, e.g. a pre-allocated,
// already-faulted buffer that is reused): one memcpy, no allocation. Borrows the slot zero-copy and
// releases it before returning. Returns the bytes written. Errors: those of get, plus
// invalid_argument when the tensor does not exist or `dst` is smaller than it.
Result<size_t> get_into(Connector& c, const std::string& from_stage, const std::string& to_stage,
                        const std::string& key, const Value* metadata, Deadline deadline,
                        std::span<std::byte> dst, size_t tensor = 0);

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

// Factory: create a connector by class name. `extra` is the config's `extra` map (plus injected
// fields such as role). Errors: not_found (unknown name), unsupported (known, not built yet).
using ConnectorCreator = std::function<Result<std::unique_ptr<Connector>>(const Value& extra)>;
Result<std::unique_ptr<Connector>> create_connector(const std::string& name, const Value& extra);
// Register a user connector under `name` (replaces an existing registration).
void register_connector(const std::string& name, ConnectorCreator creator);
std::vector<std::string> registered_connectors();

}  // namespace stagelink
