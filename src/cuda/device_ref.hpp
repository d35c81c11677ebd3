// What a frame carries for a CUDA tensor left in its producer's device arena (internal).
//
// A put of a CUDA tensor through a connector that holds device slots (the shared-memory one)
// copies the tensor device to device into a slot of the producer's arena (arena.hpp) and puts this
// record in the frame where the bytes would be: which process, which arena and where in it, the
// GPU by UUID, and the IPC handles a reader in another process opens (the arena's memory and the
// event recorded after the copy). Fixed little-endian layout, checked field by field on decode:
// the record comes from another process and is never trusted.
//
// Everything here is plain bookkeeping: it builds, runs and is tested without a GPU.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cuda/driver.hpp"
#include "stagelink/allocator.hpp"
#include "stagelink/payload.hpp"
#include "stagelink/result.hpp"

namespace stagelink::cuda {

struct DeviceRef {
  DType dtype = DType::u8;
  std::vector<int64_t> shape;
  uint32_t pid = 0;          // the producer
  uint64_t start_time = 0;   // its start time (proc_start_time): a reused pid is another process
  uint64_t arena_id = 0;     // which of its arenas (ids are never reused within a process)
  uint64_t arena_bytes = 0;  // that arena's size, checked against the mapping
  uint64_t offset = 0, nbytes = 0;
  uint32_t event_id = 0;     // which of its events (per device, reused only after a slot is freed)
  CUuuid gpu{};              // the GPU holding the arena
  CUipcMemHandle mem{};      // the arena, exported once
  CUipcEventHandle event{};  // recorded on the producer's stream after the copy into the slot
};

inline constexpr uint32_t kDeviceRefMagic = 0x52444c53;  // "SLDR"
inline constexpr uint16_t kDeviceRefVersion = 1;
inline constexpr size_t kDeviceRefFixed = 4 + 2 + 1 + 1 + 4 + 4 + 8 * 6 + 16 + 64 + 64;
inline constexpr int kDeviceRefMaxDims = 32;

std::vector<std::byte> encode_ref(const DeviceRef& r);
// Errors: corrupt (short, wrong magic or version, an unknown dtype, too many dimensions, a shape
// whose bytes are not nbytes, a slot past its arena's end).
Result<DeviceRef> decode_ref(std::span<const std::byte> b);

// Where a reader finds the GPU a record names, among its own devices.
enum class Reach {
  same_device,  // one of this process's devices is that GPU: map the arena
  peer,         // another of its devices reaches it by peer access: map it through that one
  unreachable,  // neither: the reader cannot map the producer's memory
};
struct Reachability {
  Reach how = Reach::unreachable;
  int ordinal = -1;  // the local device to map through (same_device, peer)
};
// `local`: this process's devices by ordinal; `want`: the device the reader wants the tensor on
// (-1: where it lies); `can_peer(a, b)`: whether device a reaches device b's memory.
Reachability reachability(const CUuuid& gpu, const std::vector<CUuuid>& local, int want,
                          const std::function<bool(int, int)>& can_peer);

// The slot bookkeeping of one device's arenas, apart from the memory itself (arena.cpp allocates
// that): which arena and offset a put's copy goes to, arenas added as puts outgrow them, and the
// events of slots in flight. An event is reused only once the slot it was recorded for was freed:
// re-recording one a reader may still wait on would make it wait for the wrong copy.
class SlotBook {
 public:
  explicit SlotBook(size_t arena_bytes, size_t alignment = 256) : arena_bytes_(arena_bytes), align_(alignment) {}
  struct Slot {
    uint64_t arena_id = 0;
    size_t offset = 0, bytes = 0;
    uint32_t event_id = 0;
  };
  // A slot of `n` bytes in an existing arena, or nullopt: then add_arena() first (of at least
  // arena_size_for(n) bytes) and ask again.
  std::optional<Slot> take(size_t n);
  size_t arena_size_for(size_t n) const;
  void set_arena_bytes(size_t n) { arena_bytes_ = n; }
  void add_arena(uint64_t id, size_t bytes);
  // Returns the slot and its event; corrupt for a slot not taken.
  Status give_back(const Slot& s);
  // Event ids in use or free (new ids are handed out when none is free).
  uint32_t events_made() const { return next_event_; }
  size_t slots_in_flight() const { return in_flight_; }
  size_t arenas() const { return arenas_.size(); }
  size_t capacity() const;
  size_t used() const;
  size_t largest_free() const;
  // Arenas nobody has a slot in, beyond the first (returned by drop_idle_arenas to be freed).
  std::vector<uint64_t> drop_idle_arenas();

 private:
  struct Arena {
    uint64_t id;
    BufferAllocator alloc;
    size_t slots = 0;
  };
  size_t arena_bytes_, align_;
  std::vector<Arena> arenas_;
  std::vector<uint32_t> free_events_;
  uint32_t next_event_ = 0;
  size_t in_flight_ = 0;
};

}  // namespace stagelink::cuda
