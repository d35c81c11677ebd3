// numpy arrays as typed tensors, through numpy's C API (building an array costs ~0.1 us, the
// Python route several).
#pragma once
#include "python/common.hpp"

namespace stagelink::py {

// The DType of a numpy dtype; nullopt for the ones frames do not carry.
std::optional<DType> dtype_of(PyArray_Descr* d);
// The numpy type number of `d` (the raw-bytes uint8 for the dtypes numpy lacks).
int npy_type(DType d);
// A plain numpy array (C-contiguous, a frame dtype) as the payload's one tensor, viewed (its buffer
// pinned in `bv` when the GIL may be let go); false for anything else (PyEncoder takes those).
bool array_payload(nb::handle obj, BufferViews& bv, Payload& p, bool gil_held_if_small);
// A numpy array over `data`, its base a capsule holding `keep` (a slot lease or a pooled buffer).
nb::object array_over(const std::byte* data, int type, const Dims& dims, std::shared_ptr<const void> keep,
                      bool writable);
// A new array holding a copy of `src` (1 MiB and more in a pooled host buffer).
nb::object copied_array(std::span<const std::byte> src, int type, const Dims& dims);
// A received tensor as a numpy array: a read-only view (zero_copy), memory the result owns
// (owned), or a copy.
nb::object tensor_array(const Tensor& t, bool zero_copy, bool owned = false);

}  // namespace stagelink::py
