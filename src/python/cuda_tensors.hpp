// CUDA tensors left on their GPU (the Python side of src/cuda/arena.hpp): a put through a connector
// that holds device slots copies each CUDA tensor into the producer's device arena and puts a
// record of it in the frame; a get maps the arena and returns a tensor on the reader's GPU, a view
// of the slot (zero_copy) or a copy, ordered after the producer's copy on the reader's stream.
#pragma once
#include "python/torch.hpp"

namespace stagelink::py {

// A put's device staging: set by the caller when the connector holds device slots.
struct DeviceStaging {
  size_t arena_bytes = 0;                         // each device arena's size; 0: stage through the host
  std::vector<std::shared_ptr<const void>> holds;  // the slots taken, for PutHooks::hold
};

// Copies the CUDA tensor at `ptr` (device `ordinal`, `nbytes`, C-contiguous) into a slot and
// makes `x` the record of it (a u8 tensor owning its bytes). Raises on a driver error.
void stage_cuda_tensor(const TorchApi& T, int ordinal, const void* ptr, size_t nbytes, DType dtype,
                       const std::vector<int64_t>& shape, DeviceStaging& ds, Tensor& x);

// The tensor a record `t` names, on the reader's device: a view of the slot held by `t`'s
// keepalive (`view`), else a copy. Raises unsupported when this process cannot reach that GPU.
nb::object tensor_from_ref(const TorchApi& T, const Tensor& t, bool view);

}  // namespace stagelink::py
