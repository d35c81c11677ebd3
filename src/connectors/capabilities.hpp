// The connectors' internal capabilities (the public ones are in stagelink/connector.hpp): what
// the relay asks of a connector for its credits, and the hooks stagelink's Python binding uses to
// skip copies. Nothing here is for users; options left null keep every connector's default.
#pragma once
#include <functional>
#include <span>
#include <string_view>

#include "stagelink/connector.hpp"

namespace stagelink {

// A put's binding hooks (PutOptions::hooks).
struct PutHooks {
  // Called, before put returns, with the frame of a put that travels inline in its metadata
  // (the shared-memory connector's frames up to shm_threshold_bytes), which then leaves the inline
  // field out of PutResult::metadata: the caller adds it where it builds its own metadata (the
  // Python binding makes the bytes object straight from the frame, without a copy into a Value
  // first). Called under the connector's lock: it must not call back into the connector. Other
  // connectors never call it.
  std::function<void(std::span<const std::byte>)> inline_sink;
  // Kept with the put's directory entry until every reader released it (or it was cancelled or
  // expired), then dropped: the device slots of CUDA tensors the frame refers to. Only connectors
  // whose BindingFields::device_slots() says so keep it; the frame then never travels inline
  // (a reader's claim on the entry is what keeps the slot until its GPU work on it finished).
  std::shared_ptr<const void> hold;
};

// A get's binding hooks (GetOptions::hooks).
struct GetHooks {
  // With zero_copy: a payload that travelled inline in `metadata` may be returned as views of the
  // metadata's bytes (no copy, no keepalive); the caller keeps the metadata alive and unchanged
  // while it uses them. Bindings that copy the result out at once use it.
  bool view_metadata = false;
  // With zero_copy: leave the tree as msgpack bytes in Payload::packed_tree (valid while the
  // tensors are) instead of building it; for bindings that build their own objects from it.
  bool raw_tree = false;
  // With zero_copy, for a caller that would copy the result out at once (the Python binding's
  // default get): a connector that can land the payload straight in memory of this process that
  // no one else writes (a host buffer of its own, not shared memory nor a pool region) may do so
  // and say GetResult::owned. The transfer engine does, from 1 MiB: no copy after the transfer.
  bool private_ok = false;
  // The inline frame of `metadata` when the caller left it out of the Value (its inline field,
  // BindingFields): read in place, the memory held by the caller for the call (the Python binding
  // points it at the metadata's bytes object instead of copying them into the Value). Empty: none.
  std::span<const std::byte> metadata_inline;
};

// What the relay needs for its credits: when a put's every reader released it.
class ReleaseTracking {
 public:
  static constexpr CapabilityId kId = CapabilityId::releases;
  // Whether every reader of the put `put_metadata` describes released it (or it was cancelled,
  // expired or reclaimed). Errors: corrupt (metadata that is not this connector's put metadata).
  virtual Result<bool> put_released(const Value& put_metadata) = 0;
  // A counter that moves whenever some put may have been released, and a wait (in the kernel)
  // until it moves past `seen` or `deadline` passes. Returns false on the deadline.
  virtual uint64_t release_epoch() = 0;
  virtual bool wait_release_epoch(uint64_t seen, Deadline deadline) = 0;
  // Return the memory of puts every reader has released (also done lazily by put). Returns how
  // many puts were reclaimed.
  virtual size_t reap_consumed() = 0;

 protected:
  ~ReleaseTracking() = default;
};

// The metadata fields a binding may read without converting the metadata (the shared-memory
// connector's): the field holding an inline payload's frame, and the one whose presence makes a
// get a direct lookup that never waits.
class BindingFields {
 public:
  static constexpr CapabilityId kId = CapabilityId::binding;
  virtual std::string_view inline_frame_field() const = 0;
  virtual std::string_view direct_lookup_field() const = 0;
  // Whether put keeps PutHooks::hold with the entry (and CUDA tensors may be left in a device
  // arena): the arena's size per device, 0 when not.
  virtual size_t device_slots() const { return 0; }

 protected:
  ~BindingFields() = default;
};

}  // namespace stagelink
