// CUDA tensors left on their GPU (the Python side of src/cuda/arena.hpp): a put through a connector
// that holds device slots copies each CUDA tensor into the producer's device arena and puts a
// record of it in the frame; a get maps the arena and returns a tensor on the reader's GPU, a view
// of the slot (zero_copy) or a copy, ordered after the producer's copy on the reader's stream.
#pragma once
#include <atomic>

#include "python/torch.hpp"

namespace stagelink::py {

// A put's device staging: set by the caller when the connector holds device slots.
struct DeviceStaging {
  size_t arena_bytes = 0;                         // each device arena's size; 0: stage through the host
  std::vector<std::shared_ptr<const void>> holds;  // the slots taken, for PutHooks::hold
  size_t device_bytes = 0, record_bytes = 0;       // the tensors' bytes left on their GPUs, their records'
  // The holds as one (null when none), for PutHooks::hold and RelayPutOptions::hold.
  std::shared_ptr<const void> hold() {
    if (holds.empty()) return nullptr;
    return std::make_shared<std::vector<std::shared_ptr<const void>>>(std::move(holds));
  }
};

// Copies the CUDA tensor at `ptr` (device `ordinal`, `nbytes`, C-contiguous) into a slot and
// makes `x` the record of it (a u8 tensor owning its bytes). Raises on a driver error.
void stage_cuda_tensor(const TorchApi& T, int ordinal, const void* ptr, size_t nbytes, DType dtype,
                       const std::vector<int64_t>& shape, DeviceStaging& ds, Tensor& x);

// A device tensor's bytes on the host, for a frame that carries them (a connector without device
// slots, cuda_ipc off): a CUDA tensor is copied into pinned memory from torch's caching host
// allocator (a DMA at the bus's speed, and no fresh pageable pages to fault in: 4-5x faster than
// .cpu() at 16 MiB and more), anything else, or where that fails, through .cpu().
nb::object staged_on_host(const nb::object& t);

// Where a get's caller wants its torch tensors (Connector.get's `device=`): set for the call on
// its thread by DeviceWish; none: where they came from (a frame's tensors back on their GPU). A
// get without device= touches no thread-local state: wished() reads one global counter first
// (thread-local access from a shared library costs a __tls_get_addr call, ~5% of a 1 KiB torch get).
struct DeviceWish {
  explicit DeviceWish(std::string d) : active_(!d.empty()) {
    if (!active_) return;
    prev_ = std::move(current());
    current() = std::move(d);
    active().fetch_add(1, std::memory_order_relaxed);
  }
  ~DeviceWish() {
    if (!active_) return;
    current() = std::move(prev_);
    active().fetch_sub(1, std::memory_order_relaxed);
  }
  DeviceWish(const DeviceWish&) = delete;
  DeviceWish& operator=(const DeviceWish&) = delete;
  // This thread's wish, or null (none, or an empty one).
  static const std::string* wished() {
    if (active().load(std::memory_order_relaxed) == 0) return nullptr;
    const std::string& c = current();
    return c.empty() ? nullptr : &c;
  }

 private:
  static std::string& current() {
    thread_local std::string d;
    return d;
  }
  static std::atomic<int>& active() {
    static std::atomic<int> n{0};
    return n;
  }
  bool active_;
  std::string prev_;
};

// The tensor a record `t` names: where it lies (a view of the slot held by `t`'s keepalive with
// `view`, else a copy), or where DeviceWish says ("cpu": one copy device to host; another GPU: a
// copy there). Raises unsupported when this process cannot reach that GPU.
nb::object tensor_from_ref(const TorchApi& T, const Tensor& t, bool view);

}  // namespace stagelink::py
