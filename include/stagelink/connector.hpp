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
#include "stagelink/metrics.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"
#include "stagelink/trace.hpp"

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

struct PutHooks;  // internal (connectors/capabilities.hpp): what the Python binding asks of a put
struct PutOptions {
  uint32_t readers = 0;  // fan-out: how many gets may read this put; 0 = connector default (1)
  // The request this put belongs to: cleanup(request_id) frees it (chunk keys of one request are
  // tied to it this way). Empty: the put belongs to the request named by its key alone.
  std::string_view request_id;
  const PutHooks* hooks = nullptr;  // null for every caller but stagelink's own bindings
  // A W3C traceparent (trace.hpp): sampled, the put records a span "connector.put" under it. Empty: none.
  std::string_view traceparent;
};

struct PutResult {
  size_t size = 0;  // serialized frame bytes
  Value metadata;   // small msgpack-able map for the control plane
};

struct GetHooks;  // internal (connectors/capabilities.hpp): what the Python binding asks of a get
struct GetOptions {
  // true: tensors are views into the transport's memory and keep the slot alive until dropped.
  // false: the payload owns a copy and the slot is released before get returns.
  bool zero_copy = false;
  // Asked on the getting thread at least every kWaitCheckEvery while the get waits for its key to be
  // put (never during a transfer: a payload found is always read whole); false ends the get with
  // Errc::cancelled. The Python binding runs Python's signal handlers here, so Ctrl-C ends a long
  // get. Empty: the get waits until its deadline.
  std::function<bool()> keep_waiting;
  const GetHooks* hooks = nullptr;  // null for every caller but stagelink's own bindings
  // A W3C traceparent (trace.hpp): sampled, the get records a span "connector.get" under it. Empty: none.
  std::string_view traceparent;
  std::string_view request_id;  // the request the get belongs to, for its span (optional)
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
  // writable instead of copying them. Only where the caller's hooks allowed it (private_ok).
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

// What a connector offers beyond the contract, each an interface of its own that a connector
// implements or not: ask with `c.capability<Lending>()` (nullptr: not offered). Public ones are
// below; the relay's and the bindings' are internal (src/connectors/capabilities.hpp).
enum class CapabilityId : uint8_t { lending, waiting_gets, arrivals, sender_link, releases, binding };

// What every connector counts, once, in its non-virtual put/get/cleanup (health() and the metrics
// tree read these cells; a connector counts only what is its own beyond them).
struct ConnectorCounts {
  metrics::Counter put_calls, get_calls;  // successful calls
  metrics::Timing put_time, get_time;     // of them, the timed ones (metrics::timed_start)
  metrics::Counter put_bytes, get_bytes;
  metrics::Counter put_errors[16], get_errors[16];  // by Errc (a get's not_found is a miss, not an error)
  metrics::Counter cleanups, cleaned;               // cleanup() calls, and the entries they released
  uint64_t puts() const { return put_calls.value(); }
  uint64_t gets() const { return get_calls.value(); }
  uint64_t errors() const;    // every failed put and get but timeouts and a get's not_found
  uint64_t timeouts() const;  // puts and gets that failed with timeout
};

class Connector {
 public:
  Connector();
  virtual ~Connector();
  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;
  virtual const std::string& name() const = 0;

  // Publish `payload` under key@from_to. Errors: invalid_argument (bad key), exists (key still
  // being read), exhausted (no room before the put timeout), closed, io.
  Result<PutResult> put(const std::string& from_stage, const std::string& to_stage, const std::string& key,
                        const Payload& payload, const PutOptions& opts = {}) {
    const uint64_t t0 = metrics::timed_start(0);
    const uint64_t w0 = opts.traceparent.empty() ? 0 : trace::now_ns();
    auto r = do_put(from_stage, to_stage, key, payload, opts);
    count_put(r, t0);
    if (w0) [[unlikely]]
      trace_call("connector.put", opts.traceparent, w0, from_stage, to_stage, key, opts.request_id,
                 r.ok() ? r->size : 0, r.ok() ? nullptr : &r.error());
    return r;
  }

  // Fetch key@from_to. With metadata from put(), locate it directly; without, find it by key,
  // waiting until `deadline` (kNoWait: one attempt). Blocks in the kernel, never polls.
  // Metadata this connector cannot use (another connector's, empty, not a map) is ignored: the key
  // is looked up as without it; metadata wrapped as {key: metadata} is unwrapped. Metadata that
  // is this connector's but inconsistent (another key, a generation never issued, out of bounds)
  // is `corrupt`, never another payload.
  // Errors: not_found (absent, after one attempt), timeout, cancelled (abandon_get, close),
  // corrupt (bad metadata/frame), closed.
  Result<GetResult> get(const std::string& from_stage, const std::string& to_stage, const std::string& key,
                        const Value* metadata, Deadline deadline = kNoWait, const GetOptions& opts = {}) {
    const uint64_t t0 = metrics::timed_start(1);
    const uint64_t w0 = opts.traceparent.empty() ? 0 : trace::now_ns();
    auto r = do_get(from_stage, to_stage, key, metadata, deadline, opts);
    if (r.ok()) [[likely]] {
      counts_.get_calls.add();
      if (t0) counts_.get_time.since(t0);
      counts_.get_bytes.add(r->size);
    } else {
      counts_.get_errors[size_t(r.error().code) & 15].add();
    }
    if (w0) [[unlikely]]
      trace_call("connector.get", opts.traceparent, w0, from_stage, to_stage, key, opts.request_id, r.ok() ? r->size : 0,
                 r.ok() ? nullptr : &r.error());
    return r;
  }

  // Free every unread put of this request: the put whose key equals request_id and the puts tied
  // to it with PutOptions::request_id. Nothing else ("X" never frees "X_1" unless tied to "X").
  // Returns how many entries were released.
  size_t cleanup(const std::string& request_id) {
    const size_t n = do_cleanup(request_id);
    counts_.cleanups.add();
    counts_.cleaned.add(n);
    return n;
  }
  // Counters (puts, gets, bytes_transferred, errors, timeouts, ...) and transport state.
  virtual Value health() = 0;
  // Release everything this connector owns. Idempotent; also run by the destructor.
  virtual void close() = 0;

  // What put/get/cleanup counted (health() and the metrics read these).
  const ConnectorCounts& counts() const { return counts_; }
  // The `connector` label of this connector's metrics (its descriptor's name; create_connector
  // sets it).
  void set_metrics_label(std::string label);
  std::string metrics_label() const;

  // This connector as capability C (Lending, WaitingGets, ArrivalSignals, SenderLink, ...), or
  // nullptr when it does not offer it.
  template <class C>
  C* capability() {
    return static_cast<C*>(find_capability(C::kId));
  }

 protected:
  // The implementations behind put, get and cleanup (their contracts above).
  virtual Result<PutResult> do_put(const std::string& from_stage, const std::string& to_stage,
                                   const std::string& key, const Payload& payload, const PutOptions& opts) = 0;
  virtual Result<GetResult> do_get(const std::string& from_stage, const std::string& to_stage,
                                   const std::string& key, const Value* metadata, Deadline deadline,
                                   const GetOptions& opts) = 0;
  virtual size_t do_cleanup(const std::string& request_id) = 0;

  // Count a put made another way than put() (a capability's, e.g. Lending::put_loan). `t0`:
  // metrics::timed_start(0) before it (0: not timed).
  void count_put(const Result<PutResult>& r, uint64_t t0) {
    if (r.ok()) [[likely]] {
      counts_.put_calls.add();
      if (t0) counts_.put_time.since(t0);
      counts_.put_bytes.add(r->size);
    } else {
      counts_.put_errors[size_t(r.error().code) & 15].add();
    }
  }
  // Record the span of a traced call (put or get) that began at `w0` (trace::now_ns()).
  void trace_call(const char* op, std::string_view traceparent, uint64_t w0, const std::string& from_stage,
                  const std::string& to_stage, const std::string& key, std::string_view request_id, size_t bytes,
                  const Error* error) const;
  // health()'s common keys, from counts(): connector, puts, gets, bytes_transferred, errors,
  // timeouts, cleanups.
  void add_counts(Value::Map& m) const;

  // The implementation behind capability(): `this` as the interface whose kId is `id` (returned
  // as that interface's pointer, converted to void*), or nullptr.
  virtual void* find_capability(CapabilityId id) {
    (void)id;
    return nullptr;
  }

 private:
  class Metrics;
  ConnectorCounts counts_;
  std::unique_ptr<Metrics> metrics_;  // this connector's Source in the metrics tree
};

// Zero-copy producer path: reserve room for a frame with these tensors; write them; publish
// (the shared-memory connector).
class Lending {
 public:
  static constexpr CapabilityId kId = CapabilityId::lending;
  virtual Result<Loan> loan(const Value& tree, std::span<const TensorSpec> specs) = 0;
  virtual Result<PutResult> put_loan(const std::string& from_stage, const std::string& to_stage,
                                     const std::string& key, Loan&& loan, const PutOptions& opts = {}) = 0;

 protected:
  ~Lending() = default;
};

// Gets blocked on a key can be woken (the shared-memory and store connectors).
class WaitingGets {
 public:
  static constexpr CapabilityId kId = CapabilityId::waiting_gets;
  // Wake every get of `key` (any stages) blocked in this connector; they return `cancelled`.
  // Returns how many were woken.
  virtual size_t abandon_get(const std::string& key) = 0;

 protected:
  ~WaitingGets() = default;
};

// vLLM-Omni's arrival wake-ups (get_wakeup_generation/wait_for_change) and _pending_keys (the
// shared-memory connector). Without it, callers keep a timed poll.
class ArrivalSignals {
 public:
  static constexpr CapabilityId kId = CapabilityId::arrivals;
  // A counter that moves when a put may have arrived, and a wait (in the kernel) until it moves
  // past `seen` or `deadline` passes; returns whether it moved. Hints: a receiver still gets its
  // key by get. Errors: unsupported (this instance cannot tell, e.g. closed).
  virtual Result<uint64_t> arrival_epoch() = 0;
  virtual bool wait_arrival(uint64_t seen, Deadline deadline) = 0;
  // The keys of this connector's puts that a reader may still get, oldest first.
  virtual Result<std::vector<std::string>> pending_keys() = 0;

 protected:
  ~ArrivalSignals() = default;
};

// Where a receiver finds a sender (the transfer engine).
class SenderLink {
 public:
  static constexpr CapabilityId kId = CapabilityId::sender_link;
  // Where a get without metadata finds the sender (vLLM-Omni's update_sender_info(sender_host,
  // sender_zmq_port)). Errors: invalid_argument.
  virtual Status update_sender_info(const std::string& host, int port) = 0;
  // Where a receiver reaches this connector's puts, as the keys its put metadata carries
  // (source_host, source_port); nil for one that cannot put.
  virtual Value sender_info() = 0;
  // Set up ahead of the first get what a get from the sender `sender_info` describes (those keys,
  // or a whole put's metadata; nil: the sender given by update_sender_info or the config) would
  // otherwise set up on first use: connections, endpoints, on both sides. Errors: timeout, io,
  // peer_dead, not_found (no sender known), corrupt (an info that is not this connector's).
  virtual Status connect(const Value& sender_info, Deadline deadline) = 0;

 protected:
  ~SenderLink() = default;
};

// Copy tensor `tensor` of key@from_to straight into `dst` (caller-owned, e.g. a pre-allocated,
// already-faulted buffer that is reused): one memcpy, no allocation. Borrows the slot zero-copy and
// releases it before returning. Returns the bytes written. Errors: those of get, plus
// invalid_argument when the tensor does not exist or `dst` is smaller than it.
Result<size_t> get_into(Connector& c, const std::string& from_stage, const std::string& to_stage,
                        const std::string& key, const Value* metadata, Deadline deadline,
                        std::span<std::byte> dst, size_t tensor = 0);

namespace options {
struct Schema;
}

// What a connector is, for the layers that choose one or decide how to use it (the relay, the
// pipeline's placement and config checks, the Python binding): asked of its descriptor, never
// decided by comparing class names.
enum class ConnectorTrait : uint32_t {
  host_local = 1u << 0,      // its payloads reach only processes of this host run by this user
  side_channel = 1u << 1,    // a sender serves a side channel (extra.zmq_port) that its receivers
                             // reach at sender_host:sender_zmq_port (vLLM-Omni's role-bound ones)
  pickle_default = 1u << 2,  // objects without a native frame are pickled unless extra.allow_pickle
                             // is false (only where no other user or host can write its data)
  device_slots = 1u << 3,    // CUDA tensors may stay on their GPU (a device arena read over CUDA IPC)
  lookup_gets = 1u << 4,     // a get given its put's metadata is one lookup: it never waits
  python_made = 1u << 5,     // made by stagelink's Python layer (ConnectorDescriptor::python)
};

// Factory: make a connector. `name` is the name it was asked for (an alias included: vLLM-Omni's
// callers read it back from name()); `extra` the config's `extra` map plus injected fields
// (role, stage_id, ...).
using ConnectorFactory = std::function<Result<std::unique_ptr<Connector>>(const std::string& name, const Value& extra)>;
// A user connector's factory of old (registered by name alone).
using ConnectorCreator = std::function<Result<std::unique_ptr<Connector>>(const Value& extra)>;

// The one source of what a connector is: its names, its options, its traits and how it is made.
// Registered once (the built-in ones by factory.cpp; a user's with register_connector) and listed
// by connectors(), which Python reads as `stagelink._core.connectors()`.
struct ConnectorDescriptor {
  std::string name;
  std::vector<std::string> aliases;         // other names it answers to (vLLM-Omni's)
  const options::Schema* schema = nullptr;  // its extra's keys (null: none declared)
  uint32_t traits = 0;                      // ConnectorTrait bits
  ConnectorFactory factory;                 // null for a python_made one
  // `extra` read as the factory reads it, nothing made (null: the schema's check, or none).
  std::function<Status(const Value& extra)> check;
  std::string python;  // python_made: "module:Class" that makes it
  std::string doc;     // one line, for listings
  bool has(ConnectorTrait t) const { return (traits & static_cast<uint32_t>(t)) != 0; }
};

// Create a connector by name or alias. Errors: not_found (unknown name), unsupported (known, not
// made from C++: python_made, or not built yet), those of its factory.
Result<std::unique_ptr<Connector>> create_connector(const std::string& name, const Value& extra);
// Register a connector (replaces one of the same name; its aliases then name it too).
void register_connector(ConnectorDescriptor d);
// Register a user connector under `name` with no traits (its data treated as crossing hosts).
void register_connector(const std::string& name, ConnectorCreator creator);
// The descriptor `name` (a name or an alias) names; nullopt when none.
std::optional<ConnectorDescriptor> find_connector(const std::string& name);
// Every registered connector, by name.
std::vector<ConnectorDescriptor> connectors();
// Every name create_connector takes (names and aliases), sorted.
std::vector<std::string> registered_connectors();
// A connector's `extra` read now by that connector's own option reader, as create_connector
// would read it (each value's type, range and choice; a misspelt key names the key meant),
// without making the connector. Errors: not_found (unknown name), those of the reader. A
// connector that declares neither reader nor schema: ok.
Status check_connector_options(const std::string& name, const Value& extra);

}  // namespace stagelink
