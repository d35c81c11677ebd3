// CUDA tensors between processes without a host bounce (internal): the producer's device arenas
// and the reader's mappings of them.
//
// Producer (DeviceArenas): one set of arenas per device and process, cuMemAlloc'd, exported once
// with cuIpcGetMemHandle and carved by SlotBook. stage() copies a tensor device to device into a
// slot on the caller's stream and records the slot's interprocess event after the copy; it does
// not wait. The slot is held by the returned hold, which the connector keeps with the put's
// directory entry and drops when every reader released it (so a slot is reused only after its
// readers' GPU work on it finished: they release only then, below).
//
// Reader (DeviceImports): opens each arena and event once (cached by producer pid, start time and
// id; a dead producer's are closed), waits for the producer's copy on its own stream (on the host
// when the event already completed, which is cheaper than a stream wait on an interprocess event),
// and release_after() keeps the entry claimed until the work it queued on the slot finished.
#pragma once
#include <memory>

#include "cuda/device_ref.hpp"

namespace stagelink::cuda {

// Each device arena's size unless a connector's cuda_arena_bytes says otherwise (the queue's).
inline constexpr size_t kDefaultArenaBytes = 256u << 20;

class DeviceArenas {
 public:
  static DeviceArenas& instance();
  // Copies [src, src + nbytes) of device `ordinal` into a fresh slot on `stream`, records the
  // slot's event after it, and fills `ref` (all but dtype and shape). `arena_bytes`: the size of
  // each arena added (a larger tensor gets an arena of its own size). The hold frees the slot
  // when dropped (bookkeeping only, any thread).
  Result<std::shared_ptr<const void>> stage(int ordinal, CUdeviceptr src, size_t nbytes, CUstream stream,
                                            size_t arena_bytes, DeviceRef& ref);
  // A slot of this process's own arenas and its event (a reader in the producer's process).
  Result<std::pair<CUdeviceptr, CUevent>> local(const DeviceRef& ref);
  // Per device: arenas, bytes, used, largest free, slots and events; and puts staged.
  Value health();
  struct State;  // (public for the slot holds in arena.cpp)

 private:
  DeviceArenas() = default;
  State& st();
};

class DeviceImports {
 public:
  static DeviceImports& instance();
  struct Mapped {
    CUdeviceptr ptr = 0;  // the slot, in this process
    CUevent event = nullptr;
  };
  // The slot a record names, through local device `ordinal` (which holds or reaches it).
  Result<Mapped> open(const DeviceRef& r, int ordinal);
  // `stream` ordered after the producer's copy into the slot.
  Status wait_ready(const Mapped& m, CUstream stream);
  // Drops `keep` (the reader's claim on the entry) once the work queued on `stream` so far has
  // finished. Any thread.
  void release_after(int ordinal, CUstream stream, std::shared_ptr<const void> keep);
  // Whether every release queued so far was done, waiting up to `timeout_s` (tests, close).
  bool drain(double timeout_s);
  Value health();

 private:
  DeviceImports() = default;
  struct State;
  State& st();
};

// A hold (device slots) whose readers may still be reading when its owner closes: kept, its slots
// never reused, until the process exits, rather than overwritten under a reader.
void keep_until_exit(std::shared_ptr<const void> hold);

// The primary context of device `ordinal` made current on this thread (what torch uses).
Status use_device(int ordinal);

}  // namespace stagelink::cuda
